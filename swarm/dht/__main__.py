"""``python -m swarm.dht``: a bootstrap peer that servers and clients join."""
from __future__ import annotations

import logging
import signal
import threading

import click

from swarm.cli_options import SwarmCommand, network_options, pop_network_config, run_main, setup_logging
from swarm.dht.node import start_dht, stop_dht, visible_maddrs

logger = logging.getLogger(__name__)


@click.command(cls=SwarmCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@network_options
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING"]), default="INFO", help="Logging verbosity.")
def main(log_level: str, **options) -> None:
    """Run a DHT peer and print the multiaddrs to pass to others as --initial-peers.

    A port in --host-maddrs already in use is refused (exit 4); docs/OPERATIONS.md lists every exit code."""
    setup_logging(log_level)
    network = pop_network_config(options)
    network.use_default_peers = False  # a bootstrap peer joins only the peers it is told about
    dht = start_dht(network)
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


if __name__ == "__main__":
    run_main(main)
