"""Issue 19, item 5's control: can the default backbone learn held-out addition at all when *every* weight of its
blocks and head trains (the embedding stays frozen, as in adapter training)? If not, no adapter will.

Same data, objective, batches and scoring as ``benchmarks/finetune_addition.py`` (its ``write_pairs``, ``score``
and ``answer_shape``), everything in this process.

    python benchmarks/finetune_upper_bound.py                 # the figure of docs/TRAINING.md (about 11 minutes)
    python benchmarks/finetune_upper_bound.py --steps 20 --eval-examples 10    # a quick look
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package, when run as a script

import torch  # noqa: E402
from finetune_addition import answer_shape, count, score, write_pairs  # noqa: E402

from swarm.adapters.adapter import base_of, new_adapter  # noqa: E402
from swarm.adapters.kinds import BOTTLENECK  # noqa: E402
from swarm.finetune.data import load_examples, make_batch  # noqa: E402
from swarm.finetune.trainer import sft_loss  # noqa: E402
from swarm.frontend.local import DiffusionLM  # noqa: E402
from swarm.train.data import AdditionTask  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="finetune-upper-bound", help="Directory for the data and results.json.")
    parser.add_argument("--steps", type=count(1), default=2000, help="Optimizer steps.")
    parser.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate of every block and head weight.")
    parser.add_argument("--batch-size", type=count(1), default=16, help="Problems per step.")
    parser.add_argument("--pad-response", type=count(0), default=8, help="EOS-pad every answer to this many tokens.")
    parser.add_argument("--train-examples", type=count(1), default=20000, help="Training problems (none held out).")
    parser.add_argument("--eval-examples", type=count(1), default=100, help="Held-out problems scored after training.")
    parser.add_argument("--seed", type=int, default=0, help="Seeds the problems, batches and masking.")
    parser.add_argument("--score-at", default="",
                        help="Comma-separated steps at which to score as well as at the end (a learning curve in "
                             "one run; each point is written to results.json as it comes).")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    lm = DiffusionLM.from_pretrained("default")
    backbone = lm.backbone()  # freezes the model; the blocks and head are unfrozen below
    task = AdditionTask(tokenizer=lm.tokenizer)
    eos = lm.config.eos_token_id
    examples = load_examples(write_pairs(task, args.train_examples, args.seed, out / "addition.jsonl"),
                             lm.tokenizer, eos)
    generator = torch.Generator().manual_seed(args.seed)
    # sft_loss applies an adapter; a rank-1 bottleneck whose up projection is zero is exactly the identity
    identity = new_adapter(BOTTLENECK, 1, lm.config, base_of(lm.config, lm.tokenizer), backbone.embed, generator)
    identity.requires_grad_(False)
    trained = [p for name, p in lm.model.named_parameters() if "embed" not in name]
    for parameter in trained:
        parameter.requires_grad_(True)
    optimizer = torch.optim.Adam(trained, lr=args.lr)
    score_at = {int(step) for step in args.score_at.split(",") if step.strip()} | {args.steps}
    losses, curve, started = [], [], time.perf_counter()
    for step in range(args.steps):
        rows = torch.randint(len(examples), (args.batch_size,), generator=generator)
        batch = make_batch([examples[i] for i in rows.tolist()], eos, args.pad_response)
        optimizer.zero_grad()
        loss = sft_loss(backbone, identity, batch, generator)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % 100 == 0:
            print(f"step {step + 1}: loss {sum(losses[-100:]) / 100:.3f} (mean of 100), "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
        if step + 1 in score_at:
            after = score(lm, task, args.eval_examples)
            shape = answer_shape(after.samples)
            curve.append({"step": step + 1, "samples": (step + 1) * args.batch_size, "exact": after.correct,
                          "examples": after.examples, "shape": shape})
            result = {"args": vars(args), "trained_parameters": sum(p.numel() for p in trained),
                      "loss_last_10": sum(losses[-10:]) / max(1, len(losses[-10:])), "exact": after.correct,
                      "examples": after.examples, "shape": shape, "curve": curve, "samples": after.samples[:5]}
            (out / "results.json").write_text(json.dumps(result, indent=2))
            print(f"{result['trained_parameters']} weights trained for {step + 1} steps: loss "
                  f"{result['loss_last_10']:.3f} (last 10); held-out exact match {after.correct}/{after.examples}, "
                  f"right length {shape['length']}, first digit {shape['first_digit']}, "
                  f"last digit {shape['last_digit']}", flush=True)


if __name__ == "__main__":
    main()
