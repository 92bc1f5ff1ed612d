"""``python -m swarm.weights``: name a model on the swarm, look a name up, or fetch a model's parts ahead of time.

* ``id DIR``: the model id of a checkpoint directory (the SHA-256 of its manifest; hashes every byte, once).
* ``publish DIR --name NAME --key KEY``: sign ``NAME -> id`` into the publisher's Ed25519 slot
  (``python -m swarm.governance keygen --out FILE`` makes a key). Servers of DIR serve its bytes (on by default).
* ``show NAME[@PUBLISHER]|ID``: the records under a name (each marked trusted or not), and the peers serving the
  model.
* ``fetch NAME|ID [--blocks A:B] [--head]``: fill the cache as a server of those blocks would, then exit. A NAME
  resolves only through publishers the caller trusts (``--trusted-publishers``; default the governance keys).
* ``publish`` reports success only once another peer returns the record (its own copy dropped first); otherwise
  it fails saying the record is not readable.

The manifest, record and DHT code (torch, hivemind) is imported in the commands' bodies, so that ``--help`` answers
at once.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import click

from swarm.cli.options import (
    SwarmGroup,
    network_options,
    parse_span,
    pop_network_config,
    run_main,
    setup_logging,
)
from swarm.dht.config import NetworkConfig
from swarm.dht.peers import resolve_initial_peers
from swarm.weights.limits import PUBLISH_LIFETIME

LOG_LEVELS = click.Choice(["DEBUG", "INFO", "WARNING"])
TRUSTED_PUBLISHERS_HELP = ("A publisher whose names resolve here (base64 public key or a file holding one; repeatable, "
                           "or several separated by commas). Default: the governance keys ($SWARM_GOVERNANCE_KEYS); "
                           "'none': no name resolves, the model id is required. Names by others are ignored.")


def trusted_publishers_option(command):
    return click.option("--trusted-publishers", "--trusted-publisher", "trusted_publishers", multiple=True,
                        help=TRUSTED_PUBLISHERS_HELP)(command)


def swarm_network(options: dict) -> NetworkConfig:
    """The network options of a command that needs a swarm: refused without initial peers (a new, lonely DHT
    would keep a record nobody reads)."""
    network = pop_network_config(options, client_mode=True)
    if not resolve_initial_peers(network.initial_peers, use_defaults=network.use_default_peers):
        raise click.UsageError("no swarm to work on: pass --initial-peers (or set $SWARM_INITIAL_PEERS)")
    return network


@click.group(cls=SwarmGroup, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
def main() -> None:
    """Models served by the swarm itself: named by the hash of their manifest, fetched part by checked part."""


@main.command("id")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
def model_id(directory: str) -> None:
    """Print the model id of the checkpoint in DIRECTORY."""
    from swarm.weights.holdings import built_manifest
    from swarm.weights.manifest import weight_files

    path = Path(directory).resolve()
    click.echo(built_manifest(path, weight_files(path)).model_id)


@main.command("publish")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--name", required=True, help="The name servers and clients use: --model NAME. 1-64 letters, digits, "
              "'_', '.', '-'.")
@click.option("--key", "key_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The publisher's Ed25519 private key (PEM). Only this key can overwrite the record it signs.")
@click.option("--lifetime", type=click.FloatRange(min=60), default=PUBLISH_LIFETIME,
              help="Seconds the record lives; publish again to refresh it.")
@network_options
@click.option("--log-level", type=LOG_LEVELS, default="WARNING", help="Logging verbosity.")
def publish_command(directory: str, name: str, key_path: str, lifetime: float, log_level: str, **options) -> None:
    """Publish the model in DIRECTORY under NAME, signed by --key; servers of DIRECTORY serve its bytes."""
    setup_logging(getattr(logging, log_level))
    network = swarm_network(options)  # before hashing every byte of the checkpoint
    from swarm.dht.node import start_dht, stop_dht  # after the checks: loads torch and hivemind
    from swarm.finetune.publish import author_key
    from swarm.weights.holdings import built_manifest
    from swarm.weights.manifest import weight_files
    from swarm.weights.records import PublishedModel, parse_reference, publish, read_hosts

    key = author_key(key_path)
    parse_reference(name)
    path = Path(directory).resolve()
    manifest = built_manifest(path, weight_files(path))
    record = PublishedModel.of(name, manifest)
    dht = start_dht(network)
    try:
        stored = publish(dht, key, record, lifetime)
        hosts = read_hosts(dht, manifest.model_id)
    finally:
        stop_dht(dht)
    click.echo(json.dumps(stored.to_json(), indent=2))
    click.echo(f"published {name!r} as model {stored.model_id} by publisher {stored.publisher_id} "
               f"({stored.weights_bytes / 1e9:.2f} GB of weights); {len(hosts)} peers serve it now. Servers start "
               f"with --model {name} (or {name}@{stored.publisher_id}, or the id).", err=True)


@main.command("show")
@click.argument("reference")
@trusted_publishers_option
@network_options
@click.option("--log-level", type=LOG_LEVELS, default="WARNING", help="Logging verbosity.")
def show(reference: str, trusted_publishers: tuple[str, ...], log_level: str, **options) -> None:
    """The records published under NAME[@PUBLISHER] by anyone (each marked trusted or not) or, for a model id, none;
    and the peers serving each."""
    setup_logging(getattr(logging, log_level))
    network = swarm_network(options)
    from swarm.dht.node import start_dht, stop_dht  # after the checks: loads hivemind
    from swarm.weights.records import WeightsError, parse_reference, read_hosts, read_published, reference_publishers
    from swarm.weights.source import MODEL_ID
    from swarm.weights.trust import PublisherTrust

    trust = PublisherTrust.of(trusted_publishers)

    dht = start_dht(network)
    try:
        if MODEL_ID.fullmatch(reference):
            records = [{"model_id": reference}]
        else:
            name, publisher = parse_reference(reference)
            found = read_published(dht, name, reference_publishers(publisher, trust))
            records = [dict(r.to_json(), trusted=trust.trusts(r.publisher)) for r in found
                       if publisher is None or r.publisher_id == publisher]
            if not records:
                raise WeightsError(f"no model is published under {reference!r}")
        for record in records:
            hosts = read_hosts(dht, record["model_id"])
            record["served_by"] = [{"peer_id": h.peer_id, "tensors": "all" if h.tensors is None else len(h.tensors)}
                                   for h in hosts]
    finally:
        stop_dht(dht)
    click.echo(json.dumps(records, indent=2))


@main.command("fetch")
@click.argument("reference")
@click.option("--blocks", default=None, help="Fetch the tensors of blocks START:END (default: none).")
@click.option("--head", is_flag=True, default=False, help="Also the final norm and output head.")
@click.option("--embedding", is_flag=True, default=False, help="Also the embedding (what a client loads).")
@trusted_publishers_option
@network_options
@click.option("--log-level", type=LOG_LEVELS, default="INFO", help="Logging verbosity.")
def fetch(reference: str, blocks: Optional[str], head: bool, embedding: bool, trusted_publishers: tuple[str, ...],
          log_level: str, **options) -> None:
    """Fill the cache with the manifest, small files and the tensors of the parts named, from peers. A NAME
    resolves only through publishers you trust (--trusted-publishers; default the governance keys)."""
    setup_logging(getattr(logging, log_level))
    network = pop_network_config(options, client_mode=True)  # a malformed peer is refused before torch loads
    span = parse_span(blocks)
    from swarm.models.loading import ModelFiles
    from swarm.weights.source import SwarmWeights
    from swarm.weights.trust import PublisherTrust

    trust = PublisherTrust.of(trusted_publishers)
    weights = SwarmWeights(network, trust=trust)
    try:
        files = ModelFiles(reference, resolvers=[weights.resolve])
        if span is not None:
            files.span(*span)
        if head:
            files.head()
        if embedding:
            files.embedding()
    finally:
        weights.close()
    click.echo(str(files.path))


if __name__ == "__main__":
    run_main(main)
