"""``python -m swarm.dht``: a bootstrap peer that servers and clients join.

hivemind is imported after the arguments are parsed, so that ``--help`` and a mistyped flag answer at once.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING

import click

from swarm.cli.options import SwarmCommand, network_options, pop_network_config, run_main, setup_logging
from swarm.dht.config import MAX_BLOCKS

if TYPE_CHECKING:
    from swarm.dht.validation import KeyPolicy

logger = logging.getLogger(__name__)


@click.command(cls=SwarmCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@network_options
@click.option("--dht-prefix", "prefixes", multiple=True,
              help="A model's DHT prefix (repeatable) whose keys this peer protects as servers do: under them it "
                   "stores only records readers use, bounded in size and number (docs/GOVERNANCE.md). Default: none.")
@click.option("--num-blocks", type=click.IntRange(0, MAX_BLOCKS), default=0,
              help="With --dht-prefix: the model's number of blocks (its block keys are protected too).")
@click.option("--governance-key", "governance_keys", multiple=True,
              help="With --dht-prefix: a trusted governance public key (repeatable; default $SWARM_GOVERNANCE_KEYS); "
                   "only their slots are kept under the governance key.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING"]), default="INFO", help="Logging verbosity.")
def main(prefixes: tuple[str, ...], num_blocks: int, governance_keys: tuple[str, ...], log_level: str,
         **options) -> None:
    """Run a DHT peer and print the multiaddrs to pass to others as --initial-peers.

    A port in --host-maddrs already in use is refused (exit 4); docs/OPERATIONS.md lists every exit code."""
    setup_logging(log_level)
    network = pop_network_config(options)
    network.use_default_peers = False  # a bootstrap peer joins only the peers it is told about
    protect = _protected(prefixes, num_blocks, governance_keys)
    from swarm.dht.node import start_dht, stop_dht, visible_maddrs  # after the checks: loads hivemind

    dht = start_dht(network, protect=protect)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    addrs = visible_maddrs(dht)
    click.echo("Bootstrap peer running. Others join with:", err=True)
    click.echo(f"  --initial-peers {' '.join(addrs)}", err=True)
    click.echo(f"DHT READY peer_id={dht.peer_id} maddrs={','.join(addrs)}")
    try:
        stop.wait()
    finally:  # logging, not click.echo: with the parent gone, writing to a closed pipe must not skip the stop
        logger.info("shutting down")
        stop_dht(dht)


def _protected(prefixes: tuple[str, ...], num_blocks: int, governance_keys: tuple[str, ...]) -> list[KeyPolicy]:
    """The keys of every ``--dht-prefix``; a bad governance key is a usage error."""
    if not prefixes:
        return []
    from swarm.dht.schema import protected_keys
    from swarm.governance.keys import trusted_signers

    try:
        signers = trusted_signers(governance_keys)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--governance-key") from None
    return [policy for prefix in prefixes for policy in protected_keys(prefix, num_blocks, signers)]


if __name__ == "__main__":
    run_main(main)
