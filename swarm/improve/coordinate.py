"""``python -m swarm.improve coordinate --key KEY --stream NAME:TASK:WEIGHT ...``: a stream coordinator.

Round after round it reads what the swarm shows of each stream, plans the next record by the coordinator's rules
(``swarm.improve.coordinator``) and publishes it signed (``swarm.improve.stream_records``), for readers that trust its
key (``python -m swarm.health --trusted-coordinators KEY``). What it reads, all of it checked records of others:

- each stream's live versions (every publisher of its adapter name, withdrawn contents left out), oldest first, and
  the scores the trusted auditors published of them: the curve;
- the peers that provably host each of its newest versions (``{prefix}.adapter-hosts.{sha256}``: a trainer of
  ``swarm.improve`` hosts what it publishes): the nodes, with ``--node`` added, and each stream's claim, a node's
  work being the stream's versions published since the previous record that it hosts.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import click

from swarm.cli.options import SwarmCommand, network_options, pop_network_config, setup_logging
from swarm.health.__main__ import resolve_target, target_options

if TYPE_CHECKING:
    from hivemind.dht import DHT

    from swarm.improve.coordinator import StreamSpec
    from swarm.improve.stream_records import StreamRecord
    from swarm.reports.records import AuditBook

logger = logging.getLogger(__name__)

RECENT_VERSIONS = 8  # the newest versions of a stream whose hosts are read each round


@dataclass
class Observation:
    """What one round read of one stream: its live contents oldest first, and per host the recent versions it holds."""

    contents: list[str]
    hosts: dict[str, int]  # peer id -> versions published since the previous record that it hosts
    seen: set[str]  # every peer hosting one of its newest versions


def observe(dht: DHT, prefix: str, spec: StreamSpec, since: float) -> Observation:
    from swarm.adapters.sharing import read_hosts
    from swarm.adapters.versions import live_records
    from swarm.improve.stream_records import NODE

    records = sorted(live_records(dht, prefix, spec.name), key=lambda r: (r.published, r.sha256))
    work: dict[str, int] = {}
    seen: set[str] = set()
    for record in records[-RECENT_VERSIONS:]:
        for peer in read_hosts(dht, prefix, record.sha256):
            if not NODE.fullmatch(peer):
                continue
            seen.add(peer)
            if record.published > since:
                work[peer] = work.get(peer, 0) + 1
    return Observation([r.sha256 for r in records], work, seen)


def coordinate_round(dht: DHT, key, prefix: str, specs: list[StreamSpec], book: AuditBook, extra_nodes: list[str],
                     previous: Optional[StreamRecord], patience: int, lifetime: float) -> StreamRecord:
    """Read, plan and publish one record; the record published (ValueError: a bound broken, said in one line)."""
    from swarm.improve.coordinator import audited_curve, plan_record
    from swarm.improve.stream_records import MAX_NODES, publish_streams

    book.refresh(dht)
    since = previous.published if previous is not None else 0.0
    seen = {spec.name: observe(dht, prefix, spec, since) for spec in specs}
    nodes = sorted(set(extra_nodes).union(*(o.seen for o in seen.values())))[:MAX_NODES]
    record = plan_record(prefix, specs, {s.name: audited_curve(book, seen[s.name].contents, s.task) for s in specs},
                         nodes, {name: o.hosts for name, o in seen.items()},
                         int(time.time() * 1000), time.time(), previous, patience)
    if not publish_streams(dht, key, record, lifetime):
        logger.warning("no storing peer took the stream record %d (it is tried again next round)", record.sequence)
    return record


class CoordinateCommand(SwarmCommand):
    def main(self, *args, **kwargs):
        kwargs.setdefault("prog_name", "python -m swarm.improve coordinate")
        return super().main(*args, **kwargs)


@click.command(cls=CoordinateCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@network_options
@target_options
@click.option("--key", "key_path", required=True, type=click.Path(dir_okay=False),
              help="The coordinator's Ed25519 private key (python -m swarm.governance keygen --out coordinator.key); "
                   "readers trust the records its public half signs.")
@click.option("--stream", "streams", multiple=True, required=True,
              help="A stream, NAME:TASK:WEIGHT: the adapter name its trainers publish versions under, the task its "
                   "auditors score, its weight (repeatable).")
@click.option("--node", "nodes", multiple=True, help="A trainer node's peer id to assign besides those the swarm shows "
              "hosting the streams' versions (repeatable).")
@click.option("--trusted-auditors", "--trusted-auditor", "trusted_auditors", multiple=True,
              help="Auditor whose adapter scores make the curves (base64 public key or a file holding one; "
                   "repeatable). Default: the governance keys; 'none' trusts none (every curve empty).")
@click.option("--every", type=click.FloatRange(1, 86400), default=60.0, help="Seconds between two records.")
@click.option("--rounds", type=click.IntRange(min=0), default=0, help="Records to publish; 0 publishes until stopped.")
@click.option("--patience", type=click.IntRange(1, 100), default=3,
              help="Rounds without an audited gain after which a stream has stalled and gives its nodes back.")
@click.option("--json", "as_json", is_flag=True, help="Print each record's streams as one JSON line.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), default="WARNING",
              help="Logging verbosity.")
def coordinate_main(model: Optional[str], dht_prefix: Optional[str], num_blocks: Optional[int], key_path: str,
                    streams: tuple[str, ...], nodes: tuple[str, ...], trusted_auditors: tuple[str, ...], every: float,
                    rounds: int, patience: int, as_json: bool, log_level: str, **options) -> None:
    """Publish the streams' signed record round after round: weights, pools by the weights, curves from the trusted
    auditors' scores, claims from the versions each node hosts."""
    setup_logging(log_level)
    from swarm.governance.keys import load_key_file
    from swarm.improve.coordinator import StreamSpec
    from swarm.improve.stream_records import NODE
    from swarm.reports.records import AuditBook
    from swarm.reports.records import trusted_auditors as auditor_keys

    try:
        specs = [StreamSpec.parse(text) for text in streams]
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--stream") from None
    if len({spec.name for spec in specs}) != len(specs):
        raise click.BadParameter("each stream name once", param_hint="--stream")
    bad = [node for node in nodes if not NODE.fullmatch(node)]
    if bad:
        raise click.BadParameter(f"{bad[0][:80]!r} is not a peer id", param_hint="--node")
    try:
        auditors = tuple(auditor_keys(trusted_auditors))
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--trusted-auditors") from None
    try:
        key = load_key_file(key_path, role="coordinator")
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--key") from None
    network = pop_network_config(options, client_mode=True)
    prefix, _ = resolve_target(model, dht_prefix, num_blocks or 1)
    from swarm.dht.node import start_dht, stop_dht
    from swarm.dht.schema import protected_keys
    from swarm.dht.validation import ed25519_text

    dht = start_dht(network, protect=protected_keys(prefix, auditors=auditors, coordinators=[ed25519_text(key)]))
    book, previous, done = AuditBook(prefix, frozenset(auditors)), None, 0
    try:
        while True:
            previous = coordinate_round(dht, key, prefix, specs, book, list(nodes), previous, patience,
                                        lifetime=max(3 * every, 600.0))
            views = previous.views()
            click.echo(json.dumps(views) if as_json else "; ".join(
                f"{v['stream']}: weight {v['weight']:g}, {len(v['pool'])} nodes, curve "
                f"{' '.join(f'{s:.2f}' for s in v['curve'][-4:]) or '-'}{' STALLED' if v['stalled'] else ''}"
                f"{' FLAGGED: ' + '; '.join(v['flags']) if v['flags'] else ''}" for v in views))
            done += 1
            if rounds and done >= rounds:
                return
            time.sleep(every)
    finally:
        stop_dht(dht)
