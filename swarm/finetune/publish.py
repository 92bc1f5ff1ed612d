"""``python -m swarm.finetune publish DIR --name NAME --key KEY``: publish a trained adapter under a name.

The record (base model, training metadata, size, content hash, score) is signed by the author's Ed25519 key
(``python -m swarm.governance keygen --out author.key`` makes one); the files themselves are served by servers
started with ``--serve-adapter DIR`` (see :mod:`swarm.adapters.sharing`). The adapter, key and DHT code (torch,
hivemind) is imported after the arguments are parsed, so that ``--help`` answers at once.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Optional

import click

from swarm.adapters.limits import PUBLISH_LIFETIME
from swarm.cli.options import SwarmCommand, network_options, pop_network_config, setup_logging
from swarm.dht.peers import resolve_initial_peers
from swarm.models.config import DEFAULT_MODEL
from swarm.utils.text import plural


def author_key(path: str):
    """The author's Ed25519 private key, or a one-line error saying what the file is instead."""
    from swarm.governance.keys import load_private_key

    try:
        return load_private_key(path)
    except (ValueError, TypeError) as error:
        raise click.BadParameter(f"{path} is not an Ed25519 private key (python -m swarm.governance keygen --out "
                                 f"FILE makes one): {' '.join(str(error).split()[:8])}", param_hint="--key") from None


class PublishCommand(SwarmCommand):
    """Named as users type it: ``python -m swarm.finetune publish`` (click would say ``swarm.finetune``)."""

    def main(self, *args, **kwargs):
        kwargs.setdefault("prog_name", "python -m swarm.finetune publish")
        return super().main(*args, **kwargs)


@click.command(cls=PublishCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--name", required=True, help="The name clients use: generate(adapter=NAME). 1-64 letters, digits, "
              "'_', '.', '-'.")
@click.option("--key", "key_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The author's Ed25519 private key (PEM; python -m swarm.governance keygen --out FILE makes one). "
                   "Only this key can overwrite the record it signs.")
@click.option("--score", type=float, default=None, help="Evaluation score to publish (e.g. exact match on held-out "
              "problems, as python -m swarm.eval reports it).")
@click.option("--model", default=DEFAULT_MODEL, help="The base model the adapter was trained on (checked against the "
              "adapter; gives the DHT prefix).")
@click.option("--dht-prefix", default=None, help="DHT namespace of the model (default: the model directory's name).")
@click.option("--lifetime", type=click.FloatRange(min=60), default=PUBLISH_LIFETIME,
              help="Seconds the record lives; publish again to refresh it.")
@network_options
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING"]), default="WARNING",
              help="Logging verbosity.")
def publish_main(directory: str, name: str, key_path: str, score: Optional[float], model: str,
                 dht_prefix: Optional[str], lifetime: float, log_level: str, **options) -> None:
    """Publish the adapter in DIRECTORY under NAME, signed by --key; servers serve its files with
    --serve-adapter DIRECTORY and clients use it with generate(adapter=NAME)."""
    from swarm.adapters.adapter import PromptAdapter, base_of  # after parsing: loads torch and hivemind
    from swarm.adapters.sharing import make_record, publish, read_hosts
    from swarm.dht.node import start_dht, stop_dht
    from swarm.dht.schema import default_prefix, protected_keys
    from swarm.models.loading import ModelFiles

    setup_logging(getattr(logging, log_level))
    key = author_key(key_path)
    files = ModelFiles(model)
    PromptAdapter.load(directory, base_of(files.config, files.tokenizer()))  # trained on this model, or refused
    network = pop_network_config(options, client_mode=True)
    if not resolve_initial_peers(network.initial_peers, use_defaults=network.use_default_peers):
        raise click.UsageError("no swarm to publish on: pass --initial-peers")
    prefix = dht_prefix or default_prefix(files.path)
    dht = start_dht(network, protect=protected_keys(prefix))  # it warns of replies lost for the adapter index
    try:
        record = make_record(directory, name, score, [])
        record = dataclasses.replace(record, served_by=tuple(sorted(read_hosts(dht, prefix, record.sha256))))
        stored = publish(dht, key, prefix, record, lifetime)
    finally:
        stop_dht(dht)
    click.echo(json.dumps(stored.to_json(), indent=2))
    click.echo(f"published {name!r} by author {stored.author_id} ({stored.size} bytes, sha256 {stored.sha256}); "
               f"served by {plural(len(stored.served_by), 'peer')} now. Use it with generate(adapter={name!r}) or "
               f"{name}@{stored.author_id}.", err=True)
