"""``python -m swarm.server --blocks 0:16``: host a span of a model's blocks (and/or ``--expert`` models).

Its options are made from :class:`~swarm.server.config.ServerConfig`'s declarations; torch, hivemind and the
model load only after the command line is parsed, so ``--help`` and a mistyped flag are answered at once.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Optional

import click

from swarm.cli.options import (
    SwarmCommand,
    config_options,
    default_threads,
    network_options,
    parse_span,
    pop_network_config,
    run_main,
    setup_logging,
)
from swarm.dht.config import NetworkConfig
from swarm.dht.peers import resolve_initial_peers
from swarm.server.config import ServerConfig
from swarm.utils.settings import declared
from swarm.utils.text import plural

if TYPE_CHECKING:
    from swarm.server.server import Server


def join_message(network: NetworkConfig, addrs: list[str]) -> str:
    """How this server joined, from the peers it really used (``--initial-peers``, else $SWARM_INITIAL_PEERS, else
    the bootstrap file): only a server that had none started a new swarm whose address others need."""
    peers = resolve_initial_peers(network.initial_peers, use_defaults=network.use_default_peers)
    if peers:
        through = plural(len(peers), "initial peer")
        return f"Joined the swarm through {through}; this server listens on {' '.join(addrs)}"
    return f"Started a new swarm. Others join with: --initial-peers {' '.join(addrs)}"


def print_ready(server: Server) -> None:
    from swarm.dht.node import visible_maddrs

    addrs = visible_maddrs(server.dht)
    click.echo(join_message(server.config.network, addrs), err=True)
    # One machine-readable line on stdout, so scripts and tests can wait for readiness.
    blocks = f" blocks={server.start}:{server.end}" if server.hosts_blocks else ""
    experts = f" experts={','.join(sorted(server.experts))}" if server.experts else ""
    click.echo(f"SERVER READY peer_id={server.peer_id}{blocks} maddrs={','.join(addrs)}{experts}")


@click.command(cls=SwarmCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.argument("model_argument", metavar="[MODEL]", required=False)
@click.option("--model", default=None,
              help=declared(ServerConfig, "model").spec.help + " Also the positional "
                   "MODEL (as petals.cli.run_server MODEL). Default: default.")
@click.option("--blocks", default=None, callback=lambda ctx, param, text: parse_span(text),
              help="Blocks to host as START:END (end exclusive), e.g. 0:16. Omitted: the least-covered span of "
                   "--num-blocks.")
@click.option("--expert", "experts", multiple=True,
              help="Also host a whole expert model: an embedded name (code, addition) or a checkpoint directory, "
                   "optionally as DOMAIN=NAME_OR_PATH; clients ask for it by DOMAIN (default: the model's directory "
                   "name). Repeatable. It must share --model's tokenizer, vocabulary and mask token. With --expert "
                   "and neither --blocks nor --num-blocks, the server hosts only experts.")
@network_options
@config_options(ServerConfig)  # every other setting, declared once in swarm/server/config.py
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING"]), default="INFO", help="Logging verbosity.")
def main(model_argument: Optional[str], model: Optional[str], blocks: Optional[tuple[int, int]],
         experts: tuple[str, ...], log_level: str, **options) -> None:
    """Host a span of a model's transformer blocks and/or expert models, and announce them on the swarm's DHT.

    MODEL (or --model) is an embedded name, a checkpoint directory, a Hugging Face repo id, or a swarm model id or
    published name (its blocks then come from peers); default: default.
    Errors end in one line and an exit code (docs/OPERATIONS.md): 2 a bad value, 3 the swarm cannot be joined,
    4 a port in --host-maddrs (or the identity) is in use."""
    if model_argument and model and model_argument != model:
        raise click.UsageError(f"two models given: {model_argument} (positional) and --model {model}; give one")
    setup_logging(log_level)
    network = pop_network_config(options)
    options["compute_threads"] = options["compute_threads"] or default_threads()
    config = ServerConfig(model=model_argument or model or ServerConfig.model, blocks=blocks,
                          network=network, **options)
    from swarm.server.server import Server  # after parsing: loads torch and hivemind
    from swarm.utils.collector import freeze_loaded

    freeze_loaded()  # torch's and hivemind's objects, before the DHT process forks: no collection walks them
    server = Server(config, experts)
    freeze_loaded()  # the model and the server's own state, alive until it stops
    asyncio.run(server.serve(on_ready=print_ready))


if __name__ == "__main__":
    run_main(main)
