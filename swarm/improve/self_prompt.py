"""Self-prompting: the model writes its own training data, and the task's checker decides what is kept.

Expert iteration (docs/TRAINING.md, "The swarm teaches itself"). Round 0's data is a domain's few seed examples (the
only human data). Every later round, before the trainer trains:

1. **propose** ``proposals`` new problems: from a seed, the task builds the start of a problem (a template:
   ``AdditionTask.proposal_template``), the model completes it (through the swarm or locally: the same
   ``lm.generate``), and the task's parser reads the problem the completion names (``parse_proposal``); where it names
   none, the template is completed by chance (``fill``). Both are counted: a small model proposes poorly, and the
   checker, not the model, judges correctness;
2. keep the **new** ones: not proposed in an earlier round, not a held-out problem (dropped and counted);
3. **answer** them with the adapter trained so far (greedy, the sampler settings of the task's figure);
4. **check** each answer (``task.check``: exact, character for character) and append the accepted pairs to the data
   folder as ``self-NNNN.jsonl``, which the trainer's next snapshot reads. The held-out guard
   (:mod:`swarm.improve.held_out`) checks the pairs before they are written.

Each round's record (:class:`SelfPromptRound`) says how many problems were proposed, how many the model named, how many
were new, seen before or held out, and how many answers the checker accepted; the trainer adds its figure.
"""
from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from swarm.eval.config import TaskGeneration
from swarm.eval.tasks import prompt_ids
from swarm.improve.held_out import refuse_contaminated
from swarm.train.data import Problem

logger = logging.getLogger(__name__)

ROUND_FILE = "self-{:04d}.jsonl"  # a round's accepted pairs, in the data folder
SEED_LIMIT = 64  # seed examples a template is built from (the first ones of the folder's other files)


@dataclass(frozen=True)
class SelfPromptConfig:
    proposals: int = 64  # problems proposed per round
    seed: int = 0  # the proposals' randomness (a round's own seed is this plus the round)
    model_proposals: bool = True  # ask the model to complete each template (False: fill every one by chance)
    generation: TaskGeneration = field(default_factory=TaskGeneration)  # how answers (and completions) are sampled


@dataclass
class SelfPromptRound:
    round: int
    proposed: int  # problems proposed
    by_model: int  # of which the model's completion named (the rest were completed by chance)
    new: int  # neither proposed before nor held out: these were answered
    seen: int  # proposed in an earlier round (or twice in this one)
    held_out: int  # held-out problems proposed (dropped: never answered, never written)
    accepted: int  # answers the task's checker accepted (the round's new training pairs)
    samples: list[dict[str, Any]] = field(default_factory=list)  # a few answers, accepted or not

    @property
    def acceptance(self) -> float:
        """Accepted answers per new problem."""
        return self.accepted / self.new if self.new else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "acceptance": round(self.acceptance, 4)}


class SelfPrompter:
    """One trainer's self-prompting: ``folder`` holds the seeds and the accepted pairs, ``state`` what was proposed."""

    def __init__(self, task, folder: Path, state: Path, config: SelfPromptConfig = SelfPromptConfig()):
        self.task, self.folder, self.state_path, self.config = task, Path(folder), Path(state), config
        self.state = self._load()

    def _load(self) -> dict[str, Any]:
        if self.state_path.is_file():
            return json.loads(self.state_path.read_text())
        return {"round": 0, "seen": [], "rounds": []}

    def _save(self) -> None:
        temporary = self.state_path.with_name(self.state_path.name + ".tmp")
        temporary.write_text(json.dumps(self.state))
        os.replace(temporary, self.state_path)

    def seeds(self) -> list[Problem]:
        """The folder's examples that this loop did not write (round 0's data), as problems of the task."""
        seeds = []
        for path in sorted(self.folder.glob("*.jsonl")):
            if path.name.startswith("self-"):
                continue
            for line in path.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("prompt"), str):
                    seeds.append(Problem(record["prompt"], str(record.get("response", ""))))
                if len(seeds) >= SEED_LIMIT:
                    return seeds
        return seeds

    def propose(self, lm, rng: random.Random) -> list[tuple[str, bool]]:
        """``proposals`` problems: (prompt, whether the model's completion named it)."""
        seeds = self.seeds()
        if not seeds:
            raise ValueError(f"{self.folder} holds no seed example: self-prompting starts from a domain's seeds")
        proposals = []
        for index in range(self.config.proposals):
            seed = seeds[rng.randrange(len(seeds))]
            template = self.task.proposal_template(seed, rng)
            named = None
            if self.config.model_proposals:
                completion = generate_text(lm, template, self.config.generation, self.config.seed + index)
                named = self.task.parse_proposal(template + completion)
            proposals.append((named, True) if named is not None else (self.task.fill(template, seed, rng), False))
        return proposals

    def run_round(self, lm, adapter: Optional[str]) -> SelfPromptRound:
        """Propose, answer with ``adapter`` (a directory or name; None: the base model), check, write the accepted
        pairs; the round's record."""
        number = self.state["round"] + 1
        rng = random.Random(self.config.seed * 1_000_003 + number)
        proposals = self.propose(lm, rng)
        seen = set(self.state["seen"])
        new, repeated, held_out = [], 0, 0
        for prompt, _ in proposals:
            if self.task.would_contaminate(prompt):
                held_out += 1
            elif prompt in seen:
                repeated += 1
            else:
                seen.add(prompt)
                new.append(prompt)
        options = {"adapter": adapter} if adapter is not None else {}
        answers = [generate_text(lm, prompt, self.config.generation, self.config.seed, **options) for prompt in new]
        kept = [(prompt, answer) for prompt, answer in zip(new, answers) if self.task.check(prompt, answer)]
        refuse_contaminated(self.task, [prompt for prompt, _ in kept], f"self-prompting round {number}")
        write_pairs(self.folder / ROUND_FILE.format(number), kept)
        record = SelfPromptRound(number, len(proposals), sum(by_model for _, by_model in proposals), len(new),
                                 repeated, held_out, len(kept),
                                 [{"prompt": p, "answer": a, "accepted": self.task.check(p, a)}
                                  for p, a in list(zip(new, answers))[:4]])
        self.state = {"round": number, "seen": sorted(seen), "rounds": self.state["rounds"] + [record.to_json()]}
        self._save()
        logger.info("self-prompting round %d: %d proposed (%d by the model), %d new, %d seen, %d held out, "
                    "%d answers accepted (%.2f)", number, record.proposed, record.by_model, record.new, record.seen,
                    record.held_out, record.accepted, record.acceptance)
        return record


def generate_text(lm, prompt: str, generation: TaskGeneration, seed: int, **options: Any) -> str:
    """The model's text after ``prompt`` (cut at EOS), sampled as the task's figure samples answers."""
    return lm.generate(prompt_ids(lm, prompt), **asdict(generation), seed=seed, **options).text


def write_pairs(path: Path, pairs: Sequence[tuple[str, str]]) -> None:
    """Write the pairs whole (a snapshot never reads half a round: it skips a last line without its newline)."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(json.dumps({"prompt": p, "response": a}) + "\n" for p, a in pairs))
    os.replace(temporary, path)
