"""``python -m swarm.improve.streams_demo --output DIR``: the swarm teaches itself, in one command (issue 57).

A local swarm of this machine's processes (a bootstrap peer, one server of the embedded ``addition`` model) with:

- ``--nodes`` trainer nodes, each a ``python -m swarm.improve --self-prompt N --stream-coordinator KEY`` follower that
  offers every stream (its own and ``--also-stream`` the others), from ``--seeds`` seed examples per domain and
  nothing else: a stream's first round on a node trains on the seeds, every later one on what the node proposed,
  answered and the domain's checker accepted (no human data after round 0);
- a stream coordinator (``swarm.improve coordinate``'s round, :func:`swarm.improve.coordinate.coordinate_round`) whose
  streams have weights: it publishes the signed record the nodes follow, pools sized by the weights, and the weights
  change mid-run (``--reweigh ROUND:NAME:WEIGHT``: from that round on), so a node moves between pools; a stream
  that stalls (``--patience``) gives its nodes back;
- an auditor (``swarm.audit``'s :class:`~swarm.audit.auditor.Auditor`, ``--score-adapters`` every stream's task)
  scoring every published version on fresh held-out problems through the swarm after each round: the coordinator
  reads each stream's curve from its reports (it trusts that auditor alone), and a client trusting it shows which
  version ``best:TASK`` adopts per stream;
- at the end, ``swarm.advise``'s question (``--advise-coverage``, ``--advise-blocks``) answered by the built-in rule
  and by ``best:host-blocks`` (resolved and generated through the swarm), each checked and scored.

The coordinator paces the rounds (the nodes run with ``--round-per-record``): its record of round N, published once
every node has finished round N - 1 and the auditor has scored what they published, starts every node's round N, on
the pools it gives (its weights are the schedule's for round N). A row is the state after a round. The table
(Markdown), the JSON and the plot (matplotlib) go to ``--output`` as ``streams_demo.*``.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import click

from swarm.advise.config import DEFAULT_ADAPTER
from swarm.advise.config import TASK as ADVISE_TASK
from swarm.cli.options import run_main, setup_logging
from swarm.improve import streams_report as report
from swarm.improve.demo import MODEL, Process, audited_figure, short, stop, write_report, write_seeds
from swarm.improve.streams_report import Reweigh, StreamRow, progress, weights_at

if TYPE_CHECKING:
    from swarm.improve.coordinator import StreamSpec

logger = logging.getLogger(__name__)

STREAMS = ("tagged:tagged-addition:2", "dotted:dotted-addition:1", "hosts:host-blocks:1")
REWEIGH = ("3:dotted:3",)


@dataclass
class DemoConfig:
    """The demonstration's settings (the command's options)."""

    output: Path
    streams: tuple[StreamSpec, ...]
    reweighs: tuple[Reweigh, ...]
    nodes: int = 4
    rounds: int = 5
    seeds: int = 16  # seed examples per domain: the only human data
    proposals: int = 32  # problems each node proposes per round (self-prompting)
    round_steps: int = 20
    held_out: int = 20  # the nodes' own figure
    keep: int = 1  # versions each node keeps live per stream: the auditor scores each on every stream's task
    audit_examples: int = 40  # fresh held-out problems per version and task, each auditor round
    patience: int = 10  # audited versions without a gain after which a stream has stalled
    margin: float = 0.05  # the client's adoption margin
    advise_coverage: str = "21030112"
    advise_blocks: int = 3
    round_timeout: float = 600.0

    def validate(self) -> None:
        from swarm.train.config import TASK_NAMES

        names = [spec.name for spec in self.streams]
        tasks = [spec.task for spec in self.streams if spec.task not in TASK_NAMES]
        if tasks:
            raise ValueError(f"--stream: no task {tasks[0]!r} (one of: {', '.join(TASK_NAMES)})")
        if len(set(names)) != len(names):
            raise ValueError("--stream: each stream name once")
        unknown = [r.stream for r in self.reweighs if r.stream not in names]
        if unknown:
            raise ValueError(f"--reweigh: no stream {unknown[0]!r} (the streams: {', '.join(names)})")
        if self.nodes < len(self.streams):
            raise ValueError(f"--nodes: at least one node per stream ({len(self.streams)})")


@dataclass
class Node:
    """One trainer node: its label, peer id (known before it starts: its identity file), own stream and key."""

    label: str
    peer_id: str
    own: StreamSpec
    workdir: Path
    key_path: Path
    key: Any  # Ed25519PrivateKey: its versions' publisher key
    process: Optional[Process] = None

    def histories(self, streams: list[str]) -> dict[str, list[dict[str, Any]]]:
        return report.node_histories(self.workdir, self.own.name, streams)


def make_nodes(config: DemoConfig, work: Path, prefix: str) -> list[Node]:
    """Each node's identity, key and seeds; its own stream is the one the first record assigns it (so round 1 trains
    what the coordinator asks)."""
    from swarm.dht.identity import Identity
    from swarm.governance.keys import generate_private_key
    from swarm.improve.coordinator import plan_record

    made = []
    for index in range(1, config.nodes + 1):
        workdir = work / f"node-{index}"
        workdir.mkdir(parents=True, exist_ok=True)
        for spec in config.streams:  # every node its own copy: self-prompting writes the accepted answers there
            write_seeds(workdir / f"seeds-{spec.name}", spec.task, config.seeds)
        key_path = work / f"node-{index}.key"
        made.append((f"n{index}", Identity.load_or_create(workdir / "identity.key").peer_id, workdir, key_path,
                     generate_private_key(key_path)))
    first = plan_record(prefix, weights_at(config.streams, config.reweighs, 1), {}, [m[1] for m in made], {}, 1,
                        time.time()).assignment()
    specs = {spec.name: spec for spec in config.streams}
    return [Node(label, peer, specs[first[peer]], *rest) for label, peer, *rest in made]


def node_command(node: Node, index: int, config: DemoConfig, coordinator_pub: Path, peers: list[str]) -> list[str]:
    """The follower's command line: its own stream, the others offered, one thread, the local model."""
    others = [f"{s.name}:{s.task}:{node.workdir / f'seeds-{s.name}'}" for s in config.streams if s != node.own]
    return ["-m", "swarm.improve", "--task", node.own.task, "--data", str(node.workdir / f"seeds-{node.own.name}"),
            "--name", node.own.name, "--key", str(node.key_path), "--workdir",
            str(node.workdir), "--model", MODEL, "--rounds", "0", "--round-steps", str(config.round_steps),
            "--held-out", str(config.held_out), "--self-prompt", str(config.proposals), "--keep", str(config.keep),
            "--seed", str(index), "--local-model", "--threads", "1", "--log-level", "INFO",
            "--stream-coordinator", str(coordinator_pub), "--round-per-record",
            *[a for other in others for a in ("--also-stream", other)],
            *[a for peer in peers for a in ("--initial-peers", peer)]]


class Coordinator:
    """The stream coordinator's rounds (``swarm.improve coordinate``'s code) on a DHT peer of its own, trusting the
    demonstration's auditor alone."""

    def __init__(self, key, peers: list[str], prefix: str, auditor: str, nodes: list[str], patience: int):
        from swarm.dht.config import NetworkConfig
        from swarm.dht.node import start_dht
        from swarm.dht.schema import protected_keys
        from swarm.dht.validation import ed25519_text
        from swarm.reports.records import AuditBook

        self.key, self.prefix, self.nodes, self.patience = key, prefix, nodes, patience
        self.dht = start_dht(NetworkConfig(initial_peers=peers, client_mode=True),
                             protect=protected_keys(prefix, auditors=[auditor], coordinators=[ed25519_text(key)]))
        self.book = AuditBook(prefix, frozenset([auditor]))
        self.record = None

    def publish(self, specs: list[StreamSpec]):
        from swarm.improve.coordinate import coordinate_round

        self.record = coordinate_round(self.dht, self.key, self.prefix, specs, self.book, self.nodes, self.record,
                                       self.patience, lifetime=600.0)
        logger.info("stream record %d: %s", self.record.sequence,
                    "; ".join(f"{v['stream']} w{v['weight']:g} pool {len(v['pool'])}" for v in self.record.views()))
        return self.record

    def close(self) -> None:
        from swarm.dht.node import stop_dht

        stop_dht(self.dht)


def wait_for_round(nodes: list[Node], streams: list[str], number: int, timeout: float
                   ) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every node's histories once each has finished ``number`` rounds; RuntimeError if a node died or the round took
    over ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        now = {node.label: node.histories(streams) for node in nodes}
        done = {label: report.rounds_done(histories) for label, histories in now.items()}
        if min(done.values()) >= number:
            return now
        for node in nodes:
            if node.process is not None and node.process.poll() is not None and done[node.label] < number:
                raise RuntimeError(f"node {node.label} exited ({node.process.returncode}) before round {number}; "
                                   f"see {node.workdir / 'trainer.log'}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"round {number} took over {timeout:.0f} s")
        time.sleep(0.5)


def rows_of(number: int, started, record, moved: dict, client, nodes: list[Node]) -> Iterator[StreamRow]:
    """One row per stream for round ``number``: the weight and pool of the record that started it, what the nodes
    did, the curve (and any flag) of the record after it, and what a client's ``best:TASK`` adopts then."""
    from swarm.adapters.adapter import AdapterError

    labels = {node.peer_id: node.label for node in nodes}
    keys = {node.label: node.key for node in nodes}
    before = {view["stream"]: view for view in started.views()}
    for view in record.views():
        did, given = moved[view["stream"]], before[view["stream"]]
        best, score = "-", None
        try:
            best, score = short(client.best_adapter(view["task"]), keys), audited_figure(client, view["task"])
        except AdapterError as error:  # no version of this task audited yet
            logger.info("round %d: best:%s has nothing yet (%s)", number, view["task"], error)
        pool = sorted(labels.get(peer, peer[:8]) for peer in given["pool"])
        flags = [report.labelled(flag, labels) for flag in view["flags"]]
        curve = view["curve"][-1] if view["curve"] else None
        yield StreamRow(number, view["stream"], view["task"], given["weight"], pool, did.nodes, curve,
                        len(view["curve"]), did.new, did.accepted, best, score, view["stalled"], flags)


def ask_advice(config: DemoConfig, peers: list[str], prefix: str, auditor: str) -> Optional[dict[str, Any]]:
    """``swarm.advise``'s comparison on the demonstration's question: the rule's proposal and ``best:host-blocks``'s
    (resolved and generated through the swarm), each checked, with the trusted auditor's score (None: no
    ``host-blocks`` stream ran)."""
    if not any(spec.task == ADVISE_TASK for spec in config.streams):
        return None
    from swarm.advise.advice import Advice, Question, parse_coverage, render_text, rule_proposal
    from swarm.advise.proposals import ModelSource, ask_model
    from swarm.dht.config import NetworkConfig

    question = Question(parse_coverage(config.advise_coverage), config.advise_blocks, "the demonstration's question")
    source = ModelSource(DEFAULT_ADAPTER, MODEL, NetworkConfig(initial_peers=peers, client_mode=True), prefix,
                         (auditor,))
    proposal, missing = ask_model(question, source)
    advice = Advice(question, rule_proposal(question), proposal, missing)
    click.echo("\n".join(render_text(advice)))
    return advice.to_json()


def run_demo(config: DemoConfig) -> tuple[list[StreamRow], Optional[dict[str, Any]]]:
    """Run the demonstration (see the module doc); its rows and advice, also written to ``config.output``."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from swarm.audit.auditor import Auditor
    from swarm.audit.config import AuditorConfig
    from swarm.client import DistributedDiffusionLM
    from swarm.dht.config import NetworkConfig
    from swarm.dht.schema import default_prefix
    from swarm.dht.validation import ed25519_text
    from swarm.governance.keys import generate_private_key, public_key_text
    from swarm.models.loading import ModelFiles
    from swarm.utils.local_swarm import LocalSwarm

    config.validate()
    os.environ.setdefault("SWARM_STAMP_BITS", "16")  # a private swarm: see swarm.improve.demo
    work = config.output / "work"
    if work.exists():  # a run resumes from its workdir: an earlier demonstration's nodes would start where they ended
        logger.warning("replacing the runs of an earlier demonstration in %s", work)
        shutil.rmtree(work)
    work.mkdir(parents=True)
    streams = [spec.name for spec in config.streams]
    files = ModelFiles(MODEL)
    prefix = default_prefix(files.path)
    nodes = make_nodes(config, work, prefix)
    coordinator_key = generate_private_key(work / "coordinator.key")
    (work / "coordinator.key.pub").write_text(public_key_text(coordinator_key))
    auditor_key = Ed25519PrivateKey.generate()
    auditor_pub = ed25519_text(auditor_key)
    rows: list[StreamRow] = []
    advice = None
    with LocalSwarm(fork_server=True) as swarm:
        swarm.start_bootstrap()
        swarm.start_server(MODEL, f"0:{files.config.num_layers}", "--compute-threads", "1")
        peers = swarm.initial_peers
        coordinator = Coordinator(coordinator_key, peers, prefix, auditor_pub, [n.peer_id for n in nodes],
                                  config.patience)
        auditor = client = None
        try:
            record = coordinator.publish(weights_at(config.streams, config.reweighs, 1))  # before any node starts
            for index, node in enumerate(nodes, 1):
                node.process = swarm.start_command(
                    f"node {node.label}", node_command(node, index, config, work / "coordinator.key.pub", peers),
                    log=node.workdir / "trainer.log").process
            network = NetworkConfig(initial_peers=peers, client_mode=True)
            auditor = Auditor(AuditorConfig(network=network, score_adapters=tuple(dict.fromkeys(
                spec.task for spec in config.streams)), task_examples=config.audit_examples, fresh_identity=False,
                generations=0, once=True), auditor_key, files)
            client = DistributedDiffusionLM.from_pretrained(MODEL, initial_peers=peers, route_refresh=2.0,
                                                            adoption_margin=config.margin,
                                                            trusted_auditors=(auditor_pub,))
            client.adapter_cache = work / "client-cache"
            before: dict[str, dict[str, int]] = {}
            for number in range(1, config.rounds + 1):
                now = wait_for_round(nodes, streams, number, config.round_timeout)
                auditor.run_round()
                started, record = record, coordinator.publish(weights_at(config.streams, config.reweighs, number + 1))
                rows += rows_of(number, started, record, progress(before, now, streams), client, nodes)
                before = report.done_counts(now)
                click.echo("\n".join(row.line() for row in rows[-len(streams):]))
            advice = ask_advice(config, peers, prefix, auditor_pub)
        finally:
            stop([node.process for node in nodes if node.process is not None])
            for closing in (auditor, client):
                if closing is not None:
                    closing.shutdown()
            coordinator.close()
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()}
    click.echo(write_report(config.output, "streams_demo", report.table(rows, advice),
                            {"settings": settings, "rows": [asdict(row) for row in rows], "advice": advice},
                            lambda path: report.plot(rows, advice, path)))
    return rows, advice


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--output", default="streams-demo", type=click.Path(file_okay=False),
              help="Where the table (streams_demo.md), the JSON, the plot and the runs' files (work/) go.")
@click.option("--stream", "streams", multiple=True, default=STREAMS,
              help="A stream, NAME:TASK:WEIGHT (repeatable): its nodes publish versions of NAME, the auditor scores "
                   "them on TASK.")
@click.option("--reweigh", "reweighs", multiple=True, default=REWEIGH,
              help="ROUND:NAME:WEIGHT: from round ROUND on, stream NAME has this weight (repeatable).")
@click.option("--nodes", type=click.IntRange(1, 16), default=DemoConfig.nodes, help="Trainer nodes (one thread each).")
@click.option("--rounds", type=click.IntRange(1, 50), default=DemoConfig.rounds, help="Rounds of every node.")
@click.option("--seeds", type=click.IntRange(1, 1000), default=DemoConfig.seeds,
              help="Seed examples per domain (the only human data).")
@click.option("--proposals", type=click.IntRange(1, 10_000), default=DemoConfig.proposals,
              help="Problems each node proposes per round after its first on a stream.")
@click.option("--round-steps", type=click.IntRange(1), default=DemoConfig.round_steps, help="Steps per round.")
@click.option("--held-out", type=click.IntRange(1), default=DemoConfig.held_out, help="A node's own figure's problems.")
@click.option("--keep", type=click.IntRange(1, 16), default=DemoConfig.keep,
              help="Versions each node keeps live per stream (each is audited on every stream's task every round).")
@click.option("--audit-examples", type=click.IntRange(1), default=DemoConfig.audit_examples,
              help="Fresh held-out problems per version and task, each auditor round.")
@click.option("--patience", type=click.IntRange(1, 100), default=DemoConfig.patience,
              help="Audited versions without a gain after which a stream has stalled and gives its nodes back.")
@click.option("--margin", type=click.FloatRange(0, 1), default=DemoConfig.margin,
              help="The client's adoption margin (best:TASK moves to a version audited better by this much).")
@click.option("--advise-coverage", default=DemoConfig.advise_coverage,
              help="The advise question's coverage (servers per block of an 8-block model).")
@click.option("--advise-blocks", type=click.IntRange(1, 8), default=DemoConfig.advise_blocks,
              help="The advise question's span (blocks the joining server hosts).")
@click.option("--round-timeout", type=click.FloatRange(min=10), default=DemoConfig.round_timeout,
              help="Seconds a round may take before the demonstration gives up.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING"]), default="WARNING",
              help="Logging verbosity.")
def main(output: str, streams: tuple[str, ...], reweighs: tuple[str, ...], log_level: str, **options) -> None:
    """Two (or more) domain streams teaching themselves from seed examples on pools of trainer nodes that follow a
    coordinator's weights, scored by an auditor; prints and writes the table."""
    setup_logging(getattr(logging, log_level))
    from swarm.improve.coordinator import StreamSpec

    try:
        config = DemoConfig(Path(output), tuple(StreamSpec.parse(s) for s in streams),
                            tuple(Reweigh.parse(r) for r in reweighs), **options)
        config.validate()
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    started = time.perf_counter()
    rows, _ = run_demo(config)
    click.echo("\n".join(report.summary(rows)))
    click.echo(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    run_main(main)
