"""Adoption by audit: which published adapter version ``best:TASK`` (and ``experts="auto"``) uses, and when it moves.

Only trusted auditors' measurements count (:class:`~swarm.reports.records.AuditBook` reads no other report); the
publishers' own figures play no part, so a version overfitted to the examples its trainer saw (its own figure high,
fresh problems low) wins nothing. The candidates are every live version of every published name
(``swarm.adapters.versions``; withdrawn ones never), from the publishers the reader trusts when it names some.

A version no trusted audit found right on a single problem of the task is no candidate for it: an adapter published for
another task (a stream's auditor scores every version on every stream's task) or one that broke the model would
otherwise be the best, and ``best:TASK`` adopt it, wherever nothing better was scored yet; adopting nothing (the base
model) is better than a version measured to answer nothing.

The rule, per task: with no held choice (or one no longer published or scored), take the version with the best
trusted score. Holding one, move to another only when its trusted score beats the held one's *latest* trusted score
by at least ``margin`` (a share of problems answered exactly: a lucky draw of fresh problems must not swap adapters
back and forth). Auditors re-score the versions they see each round, so when a later audit finds the held version
worse, an earlier version that now beats it by the margin takes its place again: the choice moves back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from swarm.adapters.sharing import PublishedAdapter
from swarm.reports.records import AdapterAudit, AuditBook

DEFAULT_MARGIN = 0.05


@dataclass(frozen=True)
class Adoption:
    """A choice and why: the record chosen, the trusted auditor and score it was chosen on, and the held choice it
    replaced (None when it kept the held one or there was none)."""

    record: PublishedAdapter
    auditor: str
    score: AdapterAudit
    replaced: Optional[str] = None  # the sha256 of the version it moved from


def candidates(book: AuditBook, task: str, published: Iterable[PublishedAdapter],
               publishers: frozenset[str] = frozenset()) -> list[tuple[PublishedAdapter, str, AdapterAudit]]:
    """The published versions with a trusted score on ``task`` above zero (from ``publishers``, author ids, when
    given)."""
    scores = book.adapter_scores()
    found = []
    for record in published:
        if publishers and record.author_id not in publishers:
            continue
        scored = scores.get((record.sha256, task))
        if scored is not None and scored[1].correct > 0:
            found.append((record, *scored))
    return found


def rank(candidate: tuple[PublishedAdapter, str, AdapterAudit]) -> tuple:
    record, _, score = candidate
    return score.score, score.examples, score.checked, record.name, record.author, record.sha256


def choose(book: AuditBook, task: str, published: Iterable[PublishedAdapter], held: Optional[str] = None,
           margin: float = DEFAULT_MARGIN, publishers: frozenset[str] = frozenset()) -> Optional[Adoption]:
    """The version to use for ``task`` given the one held (its sha256), by the rule of the module doc; None when no
    published version has a trusted score."""
    found = candidates(book, task, published, publishers)
    if not found:
        return None
    best = max(found, key=rank)
    current = next((c for c in found if c[0].sha256 == held), None) if held is not None else None
    if current is None:
        return Adoption(*best)
    if best[0].sha256 != held and best[2].score >= current[2].score + margin:
        return Adoption(*best, replaced=held)
    return Adoption(*current)


def to_score(published: Iterable[PublishedAdapter], scored: Mapping[tuple[str, str], AdapterAudit],
             limit: int) -> list[PublishedAdapter]:
    """What an auditor scores this round, at most ``limit`` versions: those it never scored first (newest first:
    a new version is measured in the round after it appears), then the others, the longest unscored first (each is
    measured again on fresh problems, so a later audit can find a held version worse)."""
    last: dict[str, float] = {}
    for (sha, _), entry in scored.items():
        last[sha] = max(last.get(sha, 0.0), entry.checked)
    records = {record.sha256: record for record in published}  # one content, scored once per round
    new = sorted((r for sha, r in records.items() if sha not in last), key=lambda r: r.published, reverse=True)
    old = sorted((r for sha, r in records.items() if sha in last), key=lambda r: last[r.sha256])
    return (new + old)[:limit]


def best_adapter(book: AuditBook, task: str, published: Iterable[PublishedAdapter]
                 ) -> Optional[tuple[PublishedAdapter, str, AdapterAudit]]:
    """Of the adapters published now, the one whose content has the best trusted score on ``task`` in ``book`` (ties:
    more problems scored, then the most recent score, then the name), with the auditor and its entry; None when no
    published content has one above 0 (:func:`candidates`). Authors' own claimed scores play no part."""
    return max(candidates(book, task, published), key=rank, default=None)
