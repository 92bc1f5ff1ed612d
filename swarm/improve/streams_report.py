"""The streams demonstration's bookkeeping and outputs (``python -m swarm.improve.streams_demo``, issue 57).

Which stream each trainer node worked for between two rows (read from the runs it keeps on disk: a follower keeps one
per stream, ``swarm.improve.follow.stream_workdir``), each stream's accepted-answer rate in those rounds, the weights
a schedule gives round by round, and the outputs: the table (Markdown, always), the JSON and the plot (matplotlib,
where installed). Plain data and files: no torch, no network.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from swarm.improve.demo import round_of
from swarm.improve.follow import stream_workdir

if TYPE_CHECKING:
    from swarm.improve.coordinator import StreamSpec

History = list[dict[str, Any]]  # a run's improve.json history, oldest round first


@dataclass(frozen=True)
class Reweigh:
    """From round ``round`` on, stream ``stream`` has weight ``weight`` (``ROUND:NAME:WEIGHT``)."""

    round: int
    stream: str
    weight: float

    @classmethod
    def parse(cls, text: str) -> "Reweigh":
        """``ROUND:NAME:WEIGHT``; ValueError saying what is wrong."""
        from swarm.improve.stream_records import MAX_WEIGHT, NAME

        parts = text.split(":")
        try:
            number, weight = int(parts[0]), float(parts[2])
        except (ValueError, IndexError):
            raise ValueError(f"{text[:80]!r}: ROUND:NAME:WEIGHT, e.g. 3:tagged:3") from None
        if len(parts) != 3 or not NAME.fullmatch(parts[1]) or number < 1 or not 0 <= weight <= MAX_WEIGHT:
            raise ValueError(f"{text[:80]!r}: ROUND:NAME:WEIGHT with ROUND at least 1, NAME a stream, the weight "
                             f"0-{MAX_WEIGHT:g}")
        return cls(number, parts[1], weight)


def weights_at(specs: Sequence[StreamSpec], reweighs: Sequence[Reweigh], number: int) -> list[StreamSpec]:
    """The streams as they stand for round ``number``: each weight the last reweigh at or before it sets."""
    from swarm.improve.coordinator import StreamSpec

    weights = {spec.name: spec.weight for spec in specs}
    for change in sorted(reweighs, key=lambda r: r.round):
        if change.round <= number:
            weights[change.stream] = change.weight
    return [StreamSpec(spec.name, spec.task, weights[spec.name]) for spec in specs]


def node_histories(workdir: Path, own: str, streams: Sequence[str]) -> dict[str, History]:
    """Each stream's round history as one follower node keeps it (an empty list: the node never trained it)."""
    return {name: round_of(stream_workdir(workdir, own, name))[1] for name in streams}


def rounds_done(histories: Mapping[str, History]) -> int:
    """A node's rounds in all, over every stream it trained."""
    return sum(len(history) for history in histories.values())


@dataclass
class Progress:
    """What one stream's nodes did between two rows: who trained it, and the self-prompting they recorded."""

    nodes: list[str] = field(default_factory=list)
    new: int = 0  # new problems answered (proposed, not seen before, not held out)
    accepted: int = 0  # answers the task's checker accepted

    @property
    def acceptance(self) -> Optional[float]:
        return self.accepted / self.new if self.new else None


def progress(before: Mapping[str, Mapping[str, int]], now: Mapping[str, Mapping[str, History]],
             streams: Sequence[str]) -> dict[str, Progress]:
    """Per stream, the nodes that finished rounds of it since ``before`` (node -> stream -> rounds done then) and
    those rounds' self-prompting (a round's record counts for the stream it trained)."""
    found = {name: Progress() for name in streams}
    for node, histories in sorted(now.items()):
        for stream, history in histories.items():
            done = before.get(node, {}).get(stream, 0)
            entries = [entry for entry in history if entry["round"] > done]
            if not entries or stream not in found:
                continue
            found[stream].nodes.append(node)
            for entry in entries:
                prompted = entry.get("self_prompt") or {}
                found[stream].new += int(prompted.get("new", 0))
                found[stream].accepted += int(prompted.get("accepted", 0))
    return found


def done_counts(now: Mapping[str, Mapping[str, History]]) -> dict[str, dict[str, int]]:
    """node -> stream -> the last round it finished: what :func:`progress` takes as ``before`` next time."""
    return {node: {stream: max((e["round"] for e in history), default=0) for stream, history in histories.items()}
            for node, histories in now.items()}


def labelled(text: str, labels: Mapping[str, str]) -> str:
    """``text`` (a record's flag) with every node's peer id written as its label."""
    for peer, label in labels.items():
        text = text.replace(peer, label)
    return text


@dataclass
class StreamRow:
    """One stream after one round of the demonstration."""

    round: int
    stream: str
    task: str
    weight: float  # its weight in the coordinator's record that started the round
    pool: list[str]  # the nodes that record assigned the stream
    trained: list[str]  # the nodes that finished rounds of the stream since the previous row
    curve: Optional[float]  # the audited curve of the record after the round: its versions' best trusted score
    points: int  # audited versions on that curve
    new: int
    accepted: int
    best: str  # the version a client's best:TASK adopts ("-": none audited yet)
    best_score: Optional[float]  # the trusted auditor's latest score of that version
    stalled: bool = False
    flags: list[str] = field(default_factory=list)

    @property
    def acceptance(self) -> Optional[float]:
        return self.accepted / self.new if self.new else None

    def line(self) -> str:
        def number(value: Optional[float]) -> str:
            return "-" if value is None else f"{value:.2f}"

        pool = f"{len(self.pool)}: {' '.join(self.pool)}" if self.pool else "0"
        notes = (" STALLED" if self.stalled else "") + "".join(f" FLAGGED: {flag}" for flag in self.flags)
        return (f"| {self.round} | {self.stream} ({self.task}) | {self.weight:g} | {pool}{notes} | "
                f"{' '.join(self.trained) or '-'} | {number(self.curve)} ({self.points}) | {self.best} | "
                f"{number(self.best_score)} | {self.new or '-'} | {self.accepted if self.new else '-'} | "
                f"{number(self.acceptance)} |")


HEADER = ("| round | stream (task) | weight | pool (the coordinator's record) | trained this round | audited curve "
          "(versions scored) | best:TASK adopts | its audited score | new problems | accepted | acceptance |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def advice_table(advice: Optional[Mapping[str, Any]]) -> str:
    """The advise comparison (``swarm.advise.advice.Advice.to_json``) as Markdown."""
    if advice is None:
        return "No advice asked (no `host-blocks` stream in this run).\n"
    question = advice["question"]
    lines = [f"Question: coverage {''.join(map(str, question['coverage']))}, a server of {question['blocks']} blocks "
             f"joins ({question['source']}).", "",
             "| proposer | answer | span start | best on this question | held-out score |", "|---|---|---|---|---|"]
    for label in ("rule", "model"):
        proposal = advice[label]
        if proposal is None:
            lines.append(f"| model | - | - | - | none: {advice['missing']} |")
            continue
        score = proposal["score"]
        shown = "not audited" if score is None else f"{score['correct']}/{score['examples']} = {score['score']:.3f}"
        lines.append(f"| {label}: {proposal['who']} | {proposal['answer']!r} | {proposal['start']} | "
                     f"{'yes' if proposal['right'] else 'no (best: ' + str(proposal['best_start']) + ')'} | {shown} |")
    lines += ["", f"Recommended: the {advice['recommended']} ({advice['why']})."]
    return "\n".join(lines) + "\n"


def table(rows: Sequence[StreamRow], advice: Optional[Mapping[str, Any]]) -> str:
    return "\n".join([HEADER, *(row.line() for row in rows)]) + "\n\n" + advice_table(advice)


def series(rows: Sequence[StreamRow], stream: str, attribute: str) -> tuple[list[int], list[float]]:
    """One stream's rounds and values of ``attribute`` (NaN where there is none yet)."""
    mine = [row for row in rows if row.stream == stream]
    values = [getattr(row, attribute) for row in mine]
    return [row.round for row in mine], [math.nan if v is None else float(v) for v in values]


def plot(rows: Sequence[StreamRow], advice: Optional[Mapping[str, Any]], path: Path) -> None:
    """Each stream's audited curve and acceptance per round (left), the pools per round stacked (right: every
    stream's share visible where two have the same size); the advise comparison in the title. ImportError without
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = list(dict.fromkeys(row.stream for row in rows))
    rounds = sorted({row.round for row in rows})
    figure, (scores, pools) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    stacked = [0] * len(rounds)
    for index, stream in enumerate(streams):
        colour = f"C{index}"
        scores.plot(*series(rows, stream, "curve"), "o-", color=colour, label=f"{stream}: audited (best so far)")
        scores.plot(*series(rows, stream, "acceptance"), "s:", color=colour, label=f"{stream}: acceptance")
        sizes = {row.round: len(row.pool) for row in rows if row.stream == stream}
        heights = [sizes.get(number, 0) for number in rounds]
        pools.bar(rounds, heights, 0.6, bottom=stacked, color=colour, label=stream)
        stacked = [below + height for below, height in zip(stacked, heights)]
    for axes in (scores, pools):
        axes.set_xticks(rounds)
    pools.set_yticks(range(0, max(stacked) + 1))
    pools.set_ylim(0, max(stacked) + 1)  # room for the legend above the bars
    scores.set_xlabel("round (round 1 trains on the seeds alone)")
    scores.set_ylabel("exact match / accepted share")
    scores.set_ylim(-0.02, 1.02)
    scores.legend(fontsize=7)
    scores.grid(alpha=0.3)
    pools.set_xlabel("round (the pool its record gave)")
    pools.set_ylabel("nodes (each stream's pool, stacked)")
    pools.legend(fontsize=7, ncol=len(streams), loc="upper center")
    pools.grid(alpha=0.3)
    if advice is not None and advice.get("model") is not None and advice["model"]["score"] is not None:
        figure.suptitle(f"advise: the rule {advice['rule']['score']['score']:.2f} vs the model "
                        f"{advice['model']['score']['score']:.2f} on held-out questions; recommended: "
                        f"{advice['recommended']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def summary(rows: Sequence[StreamRow]) -> list[str]:
    """Per stream: its audited curve from the first scored round to the last, and its pool sizes round by round."""
    lines = []
    for stream in dict.fromkeys(row.stream for row in rows):
        mine = [row for row in rows if row.stream == stream]
        scored = [row for row in mine if row.curve is not None]
        curve = (f"audited {scored[0].curve:.2f} (round {scored[0].round}) -> {scored[-1].curve:.2f} "
                 f"(round {scored[-1].round})" if scored else "no audited version")
        lines.append(f"{stream}: {curve}; pools {' '.join(str(len(row.pool)) for row in mine)}")
    return lines
