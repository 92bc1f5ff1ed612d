"""``python -m swarm.eval --model NAME_OR_PATH``: held-out likelihood, masked-token accuracy and task accuracy.

The options come from plain modules (:mod:`swarm.eval.config`, :mod:`swarm.train.config`); torch and the models are
imported after the arguments are parsed.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Optional

import click

from swarm.cli.options import SwarmCommand, apply_threads, gen_length_option, run_main, setup_logging, threads_option
from swarm.diffusion.config import GenerationConfig
from swarm.eval.config import TaskGeneration
from swarm.models.config import DEFAULT_MODEL
from swarm.train.config import BUILTIN_CORPORA, TASK_NAMES

if TYPE_CHECKING:
    from swarm.eval.report import ModelReport

NO_BASELINE = "none"


def models_to_run(model: str, baseline: str, adapter: Optional[str] = None) -> list[str]:
    """The model, then the comparison model unless disabled or the same checkpoint (kept when the model is scored
    with an adapter: the same model without it is then the comparison that matters)."""
    from swarm.models.loading import resolve_model_path

    if baseline == NO_BASELINE or (adapter is None and resolve_model_path(baseline) == resolve_model_path(model)):
        return [model]
    return [model, baseline]


def describe(report: ModelReport) -> list[str]:
    """Human-readable lines for one model."""
    lk = report.likelihood
    adapted = f" with the adapter {report.adapter}" if report.adapter else ""
    lines = [
        f"{report.model}{adapted}: {report.parameters / 1e6:.2f}M parameters, {report.layers} layers x "
        f"{report.hidden_size}, {report.vocab_size} ids ({report.path})",
        f"  held-out {lk.corpus}: {lk.examples} rows x {lk.seq_len} tokens, {lk.t_draws} t draws per row "
        f"({lk.elapsed_s:.1f} s)",
        f"    masked-token accuracy {lk.masked_accuracy:.4f} over {lk.masked_tokens} masked tokens",
        f"    loss bound {lk.nats_per_token:.4f} nats/token = {lk.bits_per_byte:.4f} bits/byte",
    ]
    if report.task is not None:
        task = report.task
        lines.append(f"  task {task.task}: exact match {task.correct}/{task.examples} = {task.accuracy:.4f} "
                     f"({task.elapsed_s:.1f} s; gen_length {task.generation['gen_length']}, "
                     f"steps {task.generation['steps']}, block_length {task.generation['block_length']})")
        lines += [f"    {s['prompt']}{s['output']!r}  (answer {s['answer']})" for s in task.samples]
    return lines


@click.command(cls=SwarmCommand, context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option(
    "--model",
    default=DEFAULT_MODEL,
    help="Model to evaluate: an embedded model's name (default, code, addition) or a checkpoint directory.",
)
@click.option(
    "--adapter",
    default=None,
    help="Score --model with this adapter (a directory written by python -m swarm.finetune): the likelihood "
         "figures and the task's answers; the baseline, by default the same base model, is scored without it.",
)
@click.option(
    "--baseline",
    default=DEFAULT_MODEL,
    help=f"Model scored on the same data for comparison ('{NO_BASELINE}' to skip; skipped when it is --model).",
)
@click.option(
    "--corpus",
    type=click.Choice(BUILTIN_CORPORA),
    default=None,
    help="Held-out data for the likelihood figures "
         "[default: the corpus the model was trained on, from its training.json, else prose].",
)
@click.option(
    "--data",
    "data_files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Use the held-out tail (last 5%) of these text files instead of a built-in corpus (repeatable).",
)
@click.option(
    "--task",
    type=click.Choice([*TASK_NAMES, "none"]),
    default=None,
    help="Task for exact-match accuracy on held-out problems [default: the model's training corpus when it is a task].",
)
@click.option(
    "--examples",
    type=click.IntRange(min=1),
    default=200,
    help="Held-out rows for the likelihood figures, and held-out problems for the task.",
)
@click.option(
    "--seq-len",
    type=click.IntRange(min=2),
    default=None,
    help="Tokens per held-out row, BOS included [default: each model's training sequence length, else 128].",
)
@click.option(
    "--t-draws",
    type=click.IntRange(min=1),
    default=8,
    help="Masking rates drawn per row (stratified over (0, 1]) for the likelihood bound and the accuracy.",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    help="Seed of the held-out rows, the masking noise, the problems and the sampler.",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=64, help="Rows per forward pass.")
@gen_length_option(type=click.IntRange(min=1),
    default=TaskGeneration.gen_length,
    help="Tokens generated per task answer.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=TaskGeneration.steps,
    help="Denoising steps per task answer.",
)
@click.option(
    "--block-length",
    type=click.IntRange(min=1),
    default=TaskGeneration.block_length,
    help="Sampler block length for task answers.",
)
@threads_option()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--progress/--no-progress", default=True, help="Show progress bars on stderr.")
def main(model: str, adapter: Optional[str], baseline: str, corpus: Optional[str], data_files: tuple[str, ...],
         task: Optional[str], examples: int, seq_len: Optional[int], t_draws: int, seed: int, batch_size: int,
         gen_length: int, steps: int, block_length: int, threads: Optional[int], as_json: bool,
         progress: bool) -> None:
    """Score a model on held-out data: masked-token accuracy and LLaDA's likelihood bound, plus exact-match
    accuracy on a task's held-out problems; the baseline is scored on the same rows and problems."""
    import torch  # after parsing, as the models below

    from swarm.eval.report import EvalPlan, evaluate_models, trained_on

    setup_logging(logging.WARNING)
    apply_threads(threads)
    # Bad models and impossible sampler settings are refused (one line, exit 2) before any compute.
    models = models_to_run(model, baseline, adapter)
    trained_corpus, _ = trained_on(model)
    generation = TaskGeneration(gen_length=gen_length, steps=steps, block_length=block_length)
    GenerationConfig(**asdict(generation))
    corpus_name = corpus or trained_corpus
    if task is None:
        task = trained_corpus if trained_corpus in TASK_NAMES else "none"
    plan = EvalPlan(
        corpus="files" if data_files else corpus_name, data_files=data_files, seq_len=seq_len,
        task=None if task == "none" else task, examples=examples, seed=seed, t_draws=t_draws,
        batch_size=batch_size, generation=generation, adapter=adapter,
    )
    started = time.perf_counter()
    reports = evaluate_models(models, plan, progress=progress)
    elapsed = time.perf_counter() - started
    if as_json:
        click.echo(json.dumps({"settings": plan.to_dict(), "elapsed_s": round(elapsed, 2),
                               "threads": torch.get_num_threads(), "models": [r.to_dict() for r in reports]}, indent=2))
        return
    for report in reports:
        click.echo("\n".join(describe(report)))
    click.echo(f"({elapsed:.1f} s in all, threads {torch.get_num_threads()})")


if __name__ == "__main__":
    run_main(main)
