"""``python -m swarm.eval.composition --task addition --expert addition --weight 1.0``: does composing help?

On a task's held-out problems, exact-match accuracy of the backbone alone, the expert alone, and the
backbone composed with the expert at each given weight and each given ``--top-k`` (tokens per position the
expert answers; 0: all of them) (same problems, same seeded greedy sampler, all in this process). The
composition is the one ``generate(..., experts={name: weight})`` runs for a user.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import click
from tqdm.auto import tqdm

from swarm.cli.options import apply_threads
from swarm.diffusion.config import DEFAULT_EXPERT_TOP_K, DEFAULT_TAU, MAX_EXPERT_TOP_K
from swarm.models.config import DEFAULT_MODEL
from swarm.train.config import TASK_NAMES

if TYPE_CHECKING:  # the model code (torch) loads after the arguments are parsed
    from swarm.frontend.lm import BaseDiffusionLM
    from swarm.train.data import Problem

logger = logging.getLogger(__name__)

# One block, one token per step, greedy (whatever the backbone's own defaults): the model's best short answer.
ANSWER_SETTINGS = dict(gen_length=8, steps=8, block_length=8, temperature=0.0, remasking="low_confidence")


@dataclass
class Row:
    """One configuration's score on the problems."""

    name: str
    experts: dict[str, float]
    correct: int
    examples: int
    elapsed_s: float
    clipped_steps: float = 0.0  # share of steps where any expert's clipping fired
    samples: list[dict[str, str]] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / max(1, self.examples)


def score(lm: BaseDiffusionLM, problems: Sequence[Problem], name: str, *, seed: int, tau: float,
          experts: Optional[dict[str, float]] = None, corrector_steps: int = 0, top_k: int = DEFAULT_EXPERT_TOP_K,
          progress: bool = False, keep: int = 3) -> Row:
    """Exact match of the generated text (cut at EOS) with each answer, prompts laid out as in training."""
    started = time.perf_counter()
    correct, clipped, steps, samples = 0, 0, 0, []
    for problem in tqdm(problems, desc=name, leave=False, disable=not progress):
        result = lm.generate(problem.prompt, experts=experts, expert_tau=tau, corrector_steps=corrector_steps,
                             expert_top_k=top_k, seed=seed, **ANSWER_SETTINGS)
        correct += result.text == problem.answer
        steps += len(result.telemetry)
        clipped += sum(any(t["clipped"] for t in step.get("experts", {}).values()) for step in result.telemetry)
        if len(samples) < keep:
            samples.append({"prompt": problem.prompt, "answer": problem.answer, "output": result.text})
    return Row(name, dict(experts or {}), correct, len(problems), time.perf_counter() - started,
               clipped / steps if steps else 0.0, samples)


def evaluate_composition(backbone: str, expert: str, task: str, weights: Sequence[float], *, examples: int = 200,
                         seed: int = 0, tau: float = DEFAULT_TAU, corrector_steps: int = 0,
                         top_ks: Sequence[int] = (DEFAULT_EXPERT_TOP_K,), progress: bool = False) -> list[Row]:
    """Rows for the backbone alone, the expert alone, then the composition at each weight and each top k."""
    from swarm.frontend.local import DiffusionLM
    from swarm.train.data import TASKS

    problems = TASKS[task]().problems(examples, seed, held_out=True)
    base_lm, expert_lm = DiffusionLM.from_pretrained(backbone), DiffusionLM.from_pretrained(expert)
    base_name, expert_name = Path(backbone).name, Path(expert).name  # short labels for paths
    rows = [score(base_lm, problems, f"backbone alone ({base_name})", seed=seed, tau=tau, progress=progress),
            score(expert_lm, problems, f"expert alone ({expert_name})", seed=seed, tau=tau, progress=progress)]
    for weight in weights:
        for top_k in top_ks:
            shown = f"top {top_k}" if top_k else "whole vocabulary"
            row = score(base_lm, problems, f"{base_name} + {weight:g} x {expert_name} ({shown})",
                        experts={expert: weight}, seed=seed, tau=tau, corrector_steps=corrector_steps, top_k=top_k,
                        progress=progress)
            row.experts = {expert_name: weight}
            rows.append(row)
    return rows


def markdown_table(rows: Sequence[Row]) -> list[str]:
    lines = ["| configuration | weights | exact match | accuracy | steps clipped | time |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        weights = ", ".join(f"{name}={w:g}" for name, w in row.experts.items()) or "-"
        lines.append(f"| {row.name} | {weights} | {row.correct}/{row.examples} | {row.accuracy:.3f} | "
                     f"{row.clipped_steps:.2f} | {row.elapsed_s:.0f} s |")
    return lines


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option(
    "--task",
    type=click.Choice(sorted(TASK_NAMES)),
    default="addition",
    help="Task whose held-out problems are scored.",
)
@click.option(
    "--backbone",
    default=DEFAULT_MODEL,
    help="Backbone: an embedded model's name or a checkpoint directory.",
)
@click.option(
    "--expert",
    required=True,
    help="Expert: an embedded model's name (e.g. addition) or a checkpoint directory.",
)
@click.option(
    "--weight",
    "weights",
    type=float,
    multiple=True,
    default=(1.0,),
    help="Expert weight of a composition to score (repeatable: one row each).",
)
@click.option("--tau", type=float, default=DEFAULT_TAU, help="Clipping bound of the composition (nats per token).")
@click.option(
    "--corrector-steps",
    type=int,
    default=0,
    help="Predictor-corrector steps after each step of the compositions.",
)
@click.option("--top-k", "top_ks", type=click.IntRange(0, MAX_EXPERT_TOP_K), multiple=True,
              default=(DEFAULT_EXPERT_TOP_K,),
              help="Tokens per position the expert answers (repeatable: one row each per weight; 0: the whole "
                   "vocabulary).")
@click.option("--examples", type=int, default=200, help="Held-out problems scored.")
@click.option("--seed", type=int, default=0, help="Seed of the problems and of the sampler.")
@click.option("--threads", type=int, default=1, help="torch CPU threads (small models are fastest on one).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--progress/--no-progress", default=True, help="Show progress bars on stderr.")
def main(task: str, backbone: str, expert: str, weights: tuple[float, ...], tau: float, corrector_steps: int,
         top_ks: tuple[int, ...], examples: int, seed: int, threads: int, as_json: bool, progress: bool) -> None:
    """Accuracy on a task's held-out problems: backbone alone, expert alone, and their compositions."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from swarm.models.loading import resolve_model_path

    apply_threads(threads)
    try:
        paths = {"backbone": str(resolve_model_path(backbone)), "expert": str(resolve_model_path(expert))}
        rows = evaluate_composition(backbone, expert, task, weights, examples=examples, seed=seed, tau=tau,
                                    corrector_steps=corrector_steps, top_ks=top_ks, progress=progress)
    except (FileNotFoundError, ValueError) as error:
        raise click.UsageError(str(error)) from error
    settings: dict[str, Any] = dict(task=task, examples=examples, seed=seed, tau=tau, corrector_steps=corrector_steps,
                                    top_ks=list(top_ks),
                                    **paths, **ANSWER_SETTINGS)
    if as_json:
        click.echo(json.dumps({"settings": settings, "rows": [dict(asdict(r), accuracy=r.accuracy) for r in rows]},
                              indent=2))
        return
    click.echo(f"{task}: {examples} held-out problems, seed {seed}, tau {tau:g}, corrector steps {corrector_steps}, "
               f"greedy, gen_length/steps/block_length 8")
    click.echo("\n".join(markdown_table(rows)))
    for row in rows:
        click.echo(f"  {row.name}: "
                   + "; ".join(f"{s['prompt']}{s['output']!r} (answer {s['answer']})" for s in row.samples))


if __name__ == "__main__":
    main()
