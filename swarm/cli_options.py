"""Click options shared by the commands that generate text (one definition, many commands)."""
from __future__ import annotations

from typing import Any, Callable

import click

from swarm.diffusion.config import CACHE_MODES, MAX_STALENESS, STALE_CHECKS
from swarm.diffusion.remasking import STRATEGIES


def generation_options(command: Callable) -> Callable:
    """Add the sampler's settings as options; they arrive as keyword arguments of the same names."""
    options = [
        click.option("--gen-length", type=int, default=64, show_default=True, help="Number of tokens to generate."),
        click.option("--steps", type=int, default=None, help="Denoising steps (default: gen-length, one token per step)."),
        click.option("--block-length", type=int, default=None, help="Semi-autoregressive block size (default: 32 when it divides gen-length, else gen-length)."),
        click.option("--temperature", type=float, default=0.0, show_default=True, help="Gumbel noise scale; 0 is greedy."),
        click.option("--remasking", type=click.Choice(list(STRATEGIES)), default="low_confidence", show_default=True, help="Which masked positions are unmasked first."),
        click.option("--threshold", type=float, default=None, help="Unmask every position whose confidence reaches this (Fast-dLLM); at least one per step."),
        click.option("--cfg-scale", type=float, default=0.0, show_default=True, help="Unsupervised classifier-free guidance scale (0 disables)."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of the per-step noise: same seed, same tokens."),
        click.option("--parallel-window", type=int, default=1, show_default=True, help="Picard window: states evaluated per denoiser call (1 is sequential)."),
        click.option("--staleness", type=click.IntRange(0, MAX_STALENESS), default=0, show_default=True, help="Steps decide on logits this many steps old, keeping that many more calls in flight; each is checked when its own logits arrive (0 is exact)."),
        click.option("--stale-check", type=click.Choice(list(STALE_CHECKS)), default="token", show_default=True, help="How a step decided on stale logits is checked against its own: token (each token it unmasked is predicted there), exact (same tokens as the exact run) or none; a failed check redoes the step."),
        click.option("--cache", type=click.Choice(list(CACHE_MODES)), default="none", show_default=True, help="Reuse keys/values outside the active block: prefix (before it) or dual (before and after); none is exact."),
        click.option("--cache-refresh", type=int, default=0, show_default=True, help="Refill the cache every N steps (0: only at each new block)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


GENERATION_KEYS = ("gen_length", "steps", "block_length", "temperature", "remasking", "threshold", "cfg_scale",
                   "seed", "parallel_window", "staleness", "stale_check", "cache", "cache_refresh")


def pop_generation_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    return {key: options.pop(key) for key in GENERATION_KEYS if key in options}


def network_options(command: Callable) -> Callable:
    """Options of every command that joins the swarm; they build a :class:`~swarm.dht.node.NetworkConfig`."""
    options = [
        click.option("--initial-peers", multiple=True, help="Multiaddr of a peer already in the swarm (repeatable). Default: $SWARM_INITIAL_PEERS, then the bootstrap-list file ($SWARM_BOOTSTRAP_FILE or the packaged swarm/bootstrap_peers.txt); none starts a new swarm."),
        click.option("--host-maddrs", multiple=True, default=["/ip4/127.0.0.1/tcp/0"], show_default=True, help="Multiaddrs to listen on (repeatable); use /ip4/0.0.0.0/tcp/PORT to accept other machines."),
        click.option("--announce-maddrs", multiple=True, help="Public multiaddrs to announce, e.g. behind port forwarding (repeatable)."),
        click.option("--identity-path", type=click.Path(dir_okay=False), default=None, help="Private key file giving a persistent peer id; created on first use."),
        click.option("--use-relay/--no-relay", default=True, show_default=True, help="Allow reaching and being reached through libp2p circuit relays."),
        click.option("--use-auto-relay", is_flag=True, default=False, help="Look for relays to become reachable from behind NAT."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def pop_network_config(options: dict[str, Any], client_mode: bool = False):
    from swarm.dht.node import NetworkConfig

    return NetworkConfig(
        initial_peers=list(options.pop("initial_peers")), host_maddrs=list(options.pop("host_maddrs")),
        announce_maddrs=list(options.pop("announce_maddrs")), identity_path=options.pop("identity_path"),
        use_relay=options.pop("use_relay"), use_auto_relay=options.pop("use_auto_relay"), client_mode=client_mode,
    )


def parse_span(text: str | None) -> tuple[int, int] | None:
    """``"0:16"`` -> (0, 16); a clear error for anything else."""
    if text is None:
        return None
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise click.BadParameter(f"expected START:END such as 0:16, got {text!r}") from None
    if not 0 <= start < end:
        raise click.BadParameter(f"expected 0 <= START < END, got {text!r}")
    return start, end
