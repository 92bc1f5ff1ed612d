"""``python -m swarm.improve withdraw --name NAME --version N --key KEY``: withdraw a bad version of a published name.

Clients stop using it (``NAME@N`` is refused, ``best:TASK`` never picks it) and the name goes back to the newest
version left (``swarm.adapters.versions.withdraw_version``). Only the key that published the version can withdraw it.
"""
from __future__ import annotations

import json
import logging
from typing import Optional

import click

from swarm.cli.options import SwarmCommand, setup_logging
from swarm.dht.peers import split_peers
from swarm.models.config import DEFAULT_MODEL


class WithdrawCommand(SwarmCommand):
    def main(self, *args, **kwargs):
        kwargs.setdefault("prog_name", "python -m swarm.improve withdraw")
        return super().main(*args, **kwargs)


@click.command(cls=WithdrawCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--name", required=True, help="The published adapter name.")
@click.option("--version", "number", required=True, type=click.IntRange(min=1), help="The version number to withdraw.")
@click.option("--key", "key_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The publisher's Ed25519 private key (the one that published the version).")
@click.option("--initial-peers", multiple=True, required=True, help="Multiaddr of a swarm peer (repeatable).")
@click.option("--model", default=DEFAULT_MODEL, help="The base model (gives the DHT prefix).")
@click.option("--dht-prefix", default=None, help="DHT namespace of the model (default: the model directory's name).")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING"]), default="WARNING",
              help="Logging verbosity.")
def withdraw_main(name: str, number: int, key_path: str, initial_peers: tuple[str, ...], model: str,
                  dht_prefix: Optional[str], log_level: str) -> None:
    """Withdraw version --version of --name, signed by --key; prints the name's versions as the swarm holds them."""
    setup_logging(getattr(logging, log_level))
    peers = split_peers(initial_peers, "--initial-peers")
    from swarm.finetune.publish import author_key

    key = author_key(key_path)
    from swarm.adapters.adapter import AdapterError
    from swarm.adapters.versions import withdraw_version
    from swarm.dht.config import NetworkConfig
    from swarm.dht.node import start_dht, stop_dht
    from swarm.dht.schema import default_prefix, protected_keys
    from swarm.models.loading import ModelFiles

    prefix = dht_prefix or default_prefix(ModelFiles(model).path)
    dht = start_dht(NetworkConfig(peers, client_mode=True, use_default_peers=False), protect=protected_keys(prefix))
    try:
        listed = withdraw_version(dht, key, prefix, name, number)
    except AdapterError as error:
        raise click.ClickException(str(error)) from None
    finally:
        stop_dht(dht)
    click.echo(json.dumps([v.to_json() for v in listed.versions], indent=1))
