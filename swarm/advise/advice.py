"""Which blocks a joining server should host: the built-in rule's proposal beside a model's, each judged by the
``host-blocks`` checker on this question and scored on held-out questions, and which one to follow (issue 57).

The checker is the task's (:class:`~swarm.train.data.HostBlocksTask`): the best span is the one whose coverage after
the newcomer joins, sorted weakest block first, is largest, then leftmost. The rule is the server's own
(``least_covered_window``, what ``--num-blocks`` does). The rule's score is the same checker's count on held-out
questions of the task; a model's is what the auditors the reader trusts measured (``--score-adapters host-blocks``).
The rule stays the recommendation unless the model's audited score is higher. Plain data and arithmetic: no torch, no
network (``swarm.advise.proposals`` asks the model).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from swarm.advise.config import MAX_BLOCKS, MAX_COUNT
from swarm.server.block_selection import least_covered_window
from swarm.train.data import HostBlocksTask

RULE = "least_covered_window"
RULE_EXAMPLES = 1000  # held-out questions the rule is scored on (a fixed seed: the same figure every run)
RULE_SEED = 0
ANSWER = re.compile(r"[0-9]{1,4}", re.ASCII)  # a span start as the task writes one
COUNT = re.compile(r"[0-9]{1,7}", re.ASCII)


def parse_coverage(text: str) -> tuple[int, ...]:
    """Servers per block: one digit a block as the task writes it (``21030112``) or counts separated by commas
    (``2,1,12,0``); ValueError saying why not."""
    text = text.strip()
    parts = text.split(",") if "," in text else list(text)
    if not text or len(parts) > MAX_BLOCKS:
        raise ValueError(f"--coverage: 1-{MAX_BLOCKS} blocks, e.g. 21030112 or 2,1,12,0")
    if not all(COUNT.fullmatch(part.strip()) for part in parts):
        raise ValueError(f"--coverage {text[:40]!r}: servers per block are whole numbers, e.g. 21030112 or 2,1,12,0")
    counts = tuple(int(part) for part in parts)
    if max(counts) > MAX_COUNT:
        raise ValueError(f"--coverage: at most {MAX_COUNT} servers a block")
    return counts


@dataclass(frozen=True)
class Question:
    """How many online servers hold each block, and how many consecutive blocks the newcomer will host."""

    cover: tuple[int, ...]
    span: int
    source: str  # where the coverage came from: "given" or the map it was read from

    def __post_init__(self) -> None:
        if not 1 <= len(self.cover) <= MAX_BLOCKS or not 1 <= self.span <= len(self.cover):
            raise ValueError(f"--blocks {self.span}: a server hosts 1 to {len(self.cover)} blocks of this model")

    @property
    def prompt(self) -> Optional[str]:
        """The question as the task writes it (a count over 9 written 9: what it means is "well served"), or None
        when the model has another number of blocks than the task's, so a host-blocks model cannot be asked."""
        if len(self.cover) != HostBlocksTask.BLOCKS:
            return None
        return "".join(str(min(9, c)) for c in self.cover) + f"|{self.span}="

    def after(self, start: int) -> tuple[int, ...]:
        return tuple(c + (start <= i < start + self.span) for i, c in enumerate(self.cover))

    def to_json(self) -> dict[str, Any]:
        return {"coverage": list(self.cover), "blocks": self.span, "source": self.source, "prompt": self.prompt}


@dataclass(frozen=True)
class Verdict:
    """The checker on one answer: the span it names (None: the answer names none of this question's starts), the
    coverage the swarm would have with it, and the best start."""

    start: Optional[int]
    after: Optional[tuple[int, ...]]
    best: int

    @property
    def right(self) -> bool:
        return self.start == self.best

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start, "right": self.right, "best_start": self.best,
                "coverage_after": None if self.after is None else list(self.after),
                "weakest_after": None if self.after is None else min(self.after)}


def judge(question: Question, answer: Optional[str]) -> Verdict:
    """The host-blocks checker on ``answer`` (the task's own ``best``, on the true counts)."""
    best = HostBlocksTask.best(question.cover, question.span)
    start = int(answer) if answer is not None and ANSWER.fullmatch(answer) else None
    if start is None or start > len(question.cover) - question.span:
        return Verdict(None, None, best)
    return Verdict(start, question.after(start), best)


@dataclass(frozen=True)
class Score:
    """A share of held-out questions answered right, and who measured it."""

    correct: int
    examples: int
    by: str

    @property
    def value(self) -> float:
        return self.correct / self.examples

    def to_json(self) -> dict[str, Any]:
        return {"correct": self.correct, "examples": self.examples, "score": self.value, "by": self.by}


def rule_score(examples: int = RULE_EXAMPLES, seed: int = RULE_SEED) -> Score:
    """The rule's score by the checker on ``examples`` held-out questions of the task (the auditor's kind)."""
    task = HostBlocksTask()
    problems = task.problems(examples, seed, held_out=True)
    correct = sum(task.check(p.prompt, task.rule(p.prompt) or "") for p in problems)
    return Score(correct, len(problems), f"the checker on {len(problems)} held-out questions (seed {seed})")


@dataclass(frozen=True)
class Proposal:
    """One proposer's answer to the question, the checker's verdict and its score on held-out questions (None: no
    auditor the reader trusts scored it)."""

    who: str
    answer: Optional[str]
    verdict: Verdict
    score: Optional[Score]

    def to_json(self) -> dict[str, Any]:
        return {"who": self.who, "answer": self.answer, **self.verdict.to_json(),
                "score": None if self.score is None else self.score.to_json()}


def rule_proposal(question: Question, score: Optional[Score] = None) -> Proposal:
    answer = str(least_covered_window(question.cover, question.span))
    return Proposal(RULE, answer, judge(question, answer), score or rule_score())


@dataclass(frozen=True)
class Advice:
    """The two proposals (the model's None, with ``missing`` saying why) and the recommendation."""

    question: Question
    rule: Proposal
    model: Optional[Proposal] = None
    missing: Optional[str] = None

    @property
    def recommended(self) -> Proposal:
        """The model's proposal only where its audited score is higher than the rule's."""
        model, rule = self.model, self.rule
        if model is not None and model.score is not None and model.score.value > rule.score.value:
            return model
        return rule

    @property
    def why(self) -> str:
        model, rule = self.model, self.rule
        if model is None:
            return f"no model's proposal ({self.missing})"
        if model.score is None:
            return "no auditor you trust has scored the model's proposals on held-out questions"
        relation = "higher than" if self.recommended is model else "not above"
        return (f"the model's audited score {model.score.value:.3f} is {relation} the rule's {rule.score.value:.3f} "
                "on held-out questions")

    def to_json(self) -> dict[str, Any]:
        return {"question": self.question.to_json(), "rule": self.rule.to_json(),
                "model": None if self.model is None else self.model.to_json(), "missing": self.missing,
                "recommended": "model" if self.recommended is self.model else "rule",
                "recommended_start": self.recommended.verdict.start, "why": self.why}


def span_text(start: Optional[int], span: int) -> str:
    if start is None:
        return "no span of this model"
    return f"block {start}" if span == 1 else f"blocks {start}-{start + span - 1}"


def counts_text(counts: Sequence[int]) -> str:
    return " ".join(map(str, counts))


def render_text(advice: Advice) -> list[str]:
    """The advice as lines for a terminal."""
    q = advice.question
    lines = [f"question ({q.source}): {len(q.cover)} blocks held by {counts_text(q.cover)} online servers; the "
             f"joining server hosts {q.span}"]
    for label, proposal in (("rule", advice.rule), ("model", advice.model)):
        if proposal is None:
            lines.append(f"  model: none ({advice.missing}): the rule alone")
            continue
        v = proposal.verdict
        checked = "best" if v.right else f"not best (best: {span_text(v.best, q.span)})"
        coverage = "" if v.after is None else f"; coverage after: {counts_text(v.after)} (weakest {min(v.after)})"
        score = ("not audited by an auditor you trust" if proposal.score is None else
                 f"{proposal.score.correct}/{proposal.score.examples} = {proposal.score.value:.3f} by "
                 f"{proposal.score.by}")
        lines.append(f"  {label} ({proposal.who}): {span_text(v.start, q.span)} (answer {proposal.answer!r}); "
                     f"checker: {checked}{coverage}; held-out score: {score}")
    chosen = "the model" if advice.recommended is advice.model else "the rule"
    lines.append(f"recommended: {chosen}, {span_text(advice.recommended.verdict.start, q.span)}: {advice.why}")
    return lines
