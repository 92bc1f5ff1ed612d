"""The held-out guard: no round trains on a problem its task holds out (docs/TRAINING.md, "The swarm teaches itself").

Held-out problems are a hash partition of the problems' written form (``AdditionTask.is_held_out``), so the training
data and the held-out figures stay disjoint by construction, and this guard checks it: every prompt of a round's data
is read in the task's own spelling first (``normalise``: other digits, spaces, leading zeros), so a respelt held-out
problem is caught too. A round whose data would contaminate the held-out set is refused, whoever wrote the data.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from swarm.utils.errors import SwarmError

SHOWN = 3  # contaminating prompts named in the error


class ContaminationError(SwarmError, ValueError):
    """A round's data holds held-out problems of its task."""


def contaminating(task, prompts: Iterable[str]) -> list[str]:
    """The prompts that would teach one of ``task``'s held-out problems (every one, in order)."""
    return [prompt for prompt in prompts if task.would_contaminate(prompt)]


def refuse_contaminated(task, prompts: Iterable[str], where: str) -> None:
    """ContaminationError naming the first few held-out problems found in ``prompts`` (from ``where``)."""
    found = contaminating(task, prompts)
    if found:
        shown = ", ".join(repr(prompt) for prompt in found[:SHOWN])
        raise ContaminationError(f"{where}: {len(found)} example(s) are held-out problems of {task.name} ({shown}); "
                                 "the round is refused: training on them would make every held-out figure a lie")


def prompts_of(path: Path) -> Iterable[str]:
    """The ``prompt`` of each JSON line of a snapshot (lines the trainer's own parser would refuse are skipped here:
    it names them)."""
    with path.open() as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("prompt"), str):
                yield record["prompt"]
