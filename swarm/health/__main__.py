"""``python -m swarm.health``: print the swarm's health map; the exit code says whether the model is served.

Exit codes: 0 every block has an online server, 1 some block has none (scripts and probes can alert on it),
2 bad command line, 3 the swarm could not be joined.
"""
from __future__ import annotations

import json
import logging
from typing import Optional

import click

from swarm.cli_options import network_options, pop_network_config
from swarm.dht.node import NetworkConfig, start_dht
from swarm.health.map import HealthMap, read_health_map
from swarm.health.render import render_text

EXIT_NOT_SERVED = 1
EXIT_UNREACHABLE = 3


class UnreachableSwarm(click.ClickException):
    exit_code = EXIT_UNREACHABLE


def resolve_target(model: Optional[str], dht_prefix: Optional[str], num_blocks: Optional[int]) -> tuple[str, int]:
    """The DHT prefix and block count to inspect.

    With both ``--dht-prefix`` and ``--num-blocks`` no checkpoint is needed, so an operator can check a model
    they do not have; otherwise the checkpoint's config fills what is missing, as servers do.
    """
    if dht_prefix is not None and num_blocks is not None:
        return dht_prefix, num_blocks
    from swarm.dht.schema import default_prefix
    from swarm.models.loading import DEFAULT_MODEL, ModelFiles

    try:
        files = ModelFiles(model or DEFAULT_MODEL)
    except (FileNotFoundError, ValueError) as error:
        raise click.UsageError(f"{error} (or give --dht-prefix and --num-blocks)") from error
    return dht_prefix or default_prefix(files.path), num_blocks or files.config.num_layers


def read_map(network: NetworkConfig, prefix: str, num_blocks: int) -> HealthMap:
    try:
        dht = start_dht(network)
    except Exception as error:  # hivemind raises daemon, timeout and parse errors alike; all mean "cannot join"
        raise UnreachableSwarm(f"could not join the swarm: {error}") from error
    try:
        return read_health_map(dht, prefix, num_blocks)
    finally:
        dht.shutdown()


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@network_options
@click.option("--model", default=None, help="Embedded model name or checkpoint directory; gives the DHT prefix and "
              "block count. Default: the embedded 'default' model.")
@click.option("--dht-prefix", default=None, help="DHT namespace of the model, as servers were started with "
              "(default: the model directory's name).")
@click.option("--num-blocks", type=click.IntRange(min=1), default=None,
              help="Number of transformer blocks of the model (default: from the model's config).")
@click.option("--json", "as_json", is_flag=True, help="Print the map as JSON instead of a table.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), default="WARNING",
              help="Logging verbosity.")
def main(model: Optional[str], dht_prefix: Optional[str], num_blocks: Optional[int], as_json: bool, log_level: str,
         **options) -> None:
    """Show which servers serve which blocks of a model, and which blocks no online server holds."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prefix, num_blocks = resolve_target(model, dht_prefix, num_blocks)
    health = read_map(pop_network_config(options, client_mode=True), prefix, num_blocks)
    click.echo(json.dumps(health.to_json(), indent=2) if as_json else render_text(health))
    if not health.fully_served:
        raise SystemExit(EXIT_NOT_SERVED)


if __name__ == "__main__":
    main()
