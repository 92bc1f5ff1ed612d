"""A stream coordinator's rules: the record it signs next (docs/TRAINING.md, "Stream records").

Each stream is a domain's adapter name with a task and a weight (:class:`StreamSpec`, ``NAME:TASK:WEIGHT``). Its
curve is read from the trusted auditors' reports, never from the publishers' own figures: version by version of the
name (oldest first, withdrawn ones left out), the best trusted score on the stream's task so far (a version no trusted
auditor scored adds no point). The pools are ``streams.assign`` over the nodes, from the previous record's
assignment (the fewest moves); the claims are what each stream's run says of its nodes' work. Plain data: the
coordinator's reads and its signed publication are ``swarm.improve.stream_records``'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Optional, Sequence

from swarm.improve.stream_records import MAX_CURVE, MAX_NODES, MAX_WEIGHT, NAME, StreamEntry, StreamRecord
from swarm.improve.streams import Stream, assign

if TYPE_CHECKING:
    from swarm.reports.records import AuditBook


@dataclass(frozen=True)
class StreamSpec:
    """A stream as its coordinator's operator declares it."""

    name: str  # the adapter name its trainers publish versions under
    task: str  # the task its auditors score (``--score-adapters TASK``)
    weight: float

    @classmethod
    def parse(cls, text: str) -> "StreamSpec":
        """``NAME:TASK:WEIGHT``; ValueError saying what is wrong."""
        parts = text.split(":")
        if len(parts) != 3 or not NAME.fullmatch(parts[0]) or not NAME.fullmatch(parts[1]) or len(parts[1]) > 32:
            raise ValueError(f"stream {text[:80]!r}: NAME:TASK:WEIGHT, e.g. tagged:tagged-addition:3")
        try:
            weight = float(parts[2])
        except ValueError:
            raise ValueError(f"stream {text[:80]!r}: the weight is a number") from None
        if not 0 <= weight <= MAX_WEIGHT:
            raise ValueError(f"stream {text[:80]!r}: the weight is 0-{MAX_WEIGHT:g}")
        return cls(parts[0], parts[1], weight)


def audited_curve(book: AuditBook, contents: Sequence[str], task: str) -> tuple[float, ...]:
    """The best trusted score on ``task`` so far, version by version: ``contents`` are the stream's live versions'
    sha256, oldest first (the last :data:`MAX_CURVE` points)."""
    scores = book.adapter_scores()
    curve: list[float] = []
    for sha256 in contents:
        found = scores.get((sha256, task))
        if found is None:
            continue
        curve.append(max(found[1].score, curve[-1] if curve else 0.0))
    return tuple(curve[-MAX_CURVE:])


def plan_record(prefix: str, specs: Sequence[StreamSpec], curves: Mapping[str, tuple[float, ...]],
                nodes: Iterable[str], claims: Mapping[str, Mapping[str, int]], sequence: int, published: float,
                previous: Optional[StreamRecord] = None, patience: int = 3) -> StreamRecord:
    """The next record: each stream's curve, its pool (``assign`` from the previous record's assignment) and its
    claim (node -> work its run reports). ValueError when it would break a bound readers enforce."""
    nodes = sorted(set(nodes))
    if len(nodes) > MAX_NODES:
        raise ValueError(f"a record assigns at most {MAX_NODES} nodes, not {len(nodes)}")
    streams = [Stream(spec.name, spec.weight, curves.get(spec.name, ())) for spec in specs]
    assignment = assign(streams, nodes, previous.assignment() if previous is not None else None, patience)
    entries = []
    for spec, stream in zip(specs, streams):
        claimed = sorted(claims.get(spec.name, {}).items())
        entries.append(StreamEntry(spec.name, spec.task, spec.weight, stream.curve,
                                   tuple(node for node in nodes if assignment.get(node) == spec.name),
                                   tuple(node for node, _ in claimed), tuple(work for _, work in claimed)))
    record = StreamRecord(prefix, sequence, published, tuple(entries), patience)
    record.check()
    return record
