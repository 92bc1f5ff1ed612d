"""Is a domain's seed-trained model right sometimes? The question expert iteration starts from (docs/TRAINING.md,
"The one-command demonstration").

Self-prompting keeps only answers its checker accepts, so a stream rises only when the adapter trained on its seeds
alone already answers some problems right. Per task, this trains the trainer's adapter (``swarm.improve``'s
defaults: LoRA rank 4, a head correction of rank 8, batch 16, lr 0.003) on ``--seeds`` seed examples, the local
embedded model, one thread, and prints its exact match on ``--held-out`` held-out problems after each number of
``--steps`` (cumulative: the same run continued).

    python benchmarks/seed_start.py --tasks tagged-addition,bracketed-addition,dotted-addition --steps 20,40,160
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import click
import torch

from swarm.improve.config import FALLBACK_MODEL, ImproveConfig
from swarm.improve.demo import write_examples


@click.command()
@click.option("--tasks", default="tagged-addition,bracketed-addition,dotted-addition", show_default=True)
@click.option("--seeds", type=click.IntRange(1), default=16, show_default=True, help="Seed examples per task.")
@click.option("--steps", default="20,40,160", show_default=True, help="Held-out figure after these many steps.")
@click.option("--held-out", type=click.IntRange(1), default=40, show_default=True)
def main(tasks: str, seeds: int, steps: str, held_out: int) -> None:
    from swarm.eval.tasks import evaluate_task
    from swarm.finetune.config import FinetuneConfig
    from swarm.finetune.trainer import Finetuner
    from swarm.frontend.local import DiffusionLM
    from swarm.train.data import TASKS

    torch.set_num_threads(1)
    lm = DiffusionLM.from_pretrained(FALLBACK_MODEL)
    defaults = ImproveConfig("", "", "", "", "")
    print("| task | seeds | steps | training loss | held-out exact match | e.g. (prompt, answer, output) | seconds |\n"
          "|---|---|---|---|---|---|---|")
    for name in tasks.split(","):
        task, folder = TASKS[name](), Path(tempfile.mkdtemp(prefix="seed-start-"))
        write_examples(folder / "seeds.jsonl", seeds, 7, name)  # the seeds a demonstration's stream starts from
        trainer = None
        for total in (int(s) for s in steps.split(",")):
            started = time.perf_counter()
            if trainer is None:
                trainer = Finetuner(lm, FinetuneConfig(
                    data=str(folder / "seeds.jsonl"), output=str(folder / "adapter"), steps=total, lr=defaults.lr,
                    batch_size=defaults.batch_size, adapter_kind=defaults.adapter_kind, rank=defaults.rank,
                    head_rank=defaults.head_rank, pad_response=defaults.pad_response, seed=1, save_every=total))
            trainer.config.steps = total
            trainer.run(progress=False)
            report = evaluate_task(lm, task, examples=held_out, seed=1,
                                   generate_options={"adapter": str(folder / "adapter")})
            sample, seconds = report.samples[0], time.perf_counter() - started
            print(f"| {name} | {seeds} | {total} | {trainer.smoothed_loss():.3f} | {report.correct}/{report.examples} "
                  f"| {sample['prompt']} {sample['answer']} {sample['output']!r} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
