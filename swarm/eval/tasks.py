"""Exact-match accuracy on held-out problems of a task, generating with the real sampler.

The model answers each prompt through :class:`swarm.DiffusionLM` exactly as a user's call would (greedy,
seeded), so the figure measures the shipped generation path and not a shortcut around it.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional, Protocol, Sequence

from tqdm.auto import tqdm

from swarm.eval.config import TaskGeneration
from swarm.frontend.lm import BaseDiffusionLM
from swarm.train.data import Problem


class Task(Protocol):
    name: str

    def problems(self, count: int, seed: int, held_out: bool) -> list[Problem]: ...


@dataclass
class TaskReport:
    task: str
    examples: int
    correct: int
    accuracy: float
    generation: dict[str, Any]
    samples: list[dict[str, str]] = field(default_factory=list)  # the first few answers, right or wrong
    elapsed_s: float = 0.0


def prompt_ids(lm: BaseDiffusionLM, prompt: str) -> list[int]:
    """``[BOS] + bytes``: the layout of the training rows, with the answer left to the model."""
    bos = lm.tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + lm.tokenizer.encode(prompt)


def task_answer(lm: BaseDiffusionLM, prompt: str, settings: Mapping[str, Any],
                generate_options: Optional[Mapping[str, Any]] = None) -> str:
    """The model's answer to one task prompt (cut at EOS), generated as every scored answer is: ``settings`` are a
    :class:`TaskGeneration`'s fields and a seed, ``generate_options`` extra keywords (an adapter, experts)."""
    return lm.generate(prompt_ids(lm, prompt), **{**settings, **(generate_options or {})}).text


def evaluate_task(
    lm: BaseDiffusionLM, task: Task, *, examples: int = 200, seed: int = 0,
    generation: TaskGeneration = TaskGeneration(), progress: bool = False, keep: int = 5,
    generate_options: Optional[Mapping[str, Any]] = None,
) -> TaskReport:
    """Share of held-out problems whose generated text (cut at EOS) equals the answer exactly.

    ``generate_options`` are extra keywords for ``lm.generate`` (expert composition passes its experts),
    so every configuration is scored by this one loop.
    """
    started = time.perf_counter()
    problems: Sequence[Problem] = task.problems(examples, seed, held_out=True)
    settings: dict[str, Any] = {**asdict(generation), "seed": seed}
    correct, samples = 0, []
    for problem in tqdm(problems, desc=f"task {task.name}", leave=False, disable=not progress):
        output = task_answer(lm, problem.prompt, settings, generate_options)
        correct += output == problem.answer
        if len(samples) < keep:
            samples.append({"prompt": problem.prompt, "answer": problem.answer, "output": output})
    return TaskReport(
        task=task.name, examples=len(problems), correct=correct, accuracy=correct / max(1, len(problems)),
        generation={k: v for k, v in settings.items() if k != "seed"}, samples=samples,
        elapsed_s=time.perf_counter() - started,
    )
