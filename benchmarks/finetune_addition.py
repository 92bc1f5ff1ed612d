"""Issue 19, item 5: does an adapter trained through a 2-server swarm teach the default backbone addition?

One run, everything measured, nothing assumed:

1. writes ``--train-examples`` training problems of ``swarm.train.data.AdditionTask`` (held-out ones excluded) as
   prompt/response pairs, in the model's own tokenizer;
2. scores the backbone alone on ``--eval-examples`` held-out problems (``swarm.eval.tasks.evaluate_task``: exact
   match of the generated text cut at EOS);
3. starts a local swarm (a bootstrap peer and two servers, each holding half of the model's blocks) and trains
   an adapter (``--adapter-kind``, a bottleneck by default) through it with ``swarm.finetune`` (forward and
   backward calls to the servers);
4. trains the same adapter locally for ``--timing-steps`` steps from the same seed: per-step wall-clock side by
   side, and the losses of those steps compared (the two runs follow one trajectory);
5. scores the trained adapter on the same held-out problems (locally: the swarm gives the same tokens, which
   ``--swarm-check`` problems confirm through the swarm).

Sizes (vocabulary, hidden size, depth) are read from the model, so it runs on whichever model ``--model`` names.

    # the LoRA demonstration of docs/TRAINING.md (about 70 minutes on 2 cores)
    python benchmarks/finetune_addition.py --output demo_lora --adapter-kind lora --rank 16 --head-rank 32 \
        --down-scale 4 --max-grad-norm 1 --lr 0.002 --lr-from 2100:0.001 --batch-size 64 --steps 3000 \
        --train-examples 500000 --threads 2
    python benchmarks/finetune_addition.py --output demo           # the first (bottleneck) figures
    python benchmarks/finetune_addition.py --steps 50 --eval-examples 20 --json   # a quick look
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package, when run as a script

import torch  # noqa: E402

from swarm.adapters.kinds import BOTTLENECK, KINDS, RANKED_KINDS  # noqa: E402
from swarm.eval.tasks import TaskGeneration, TaskReport, evaluate_task, prompt_ids  # noqa: E402
from swarm.finetune.config import FinetuneConfig, parse_lr_from  # noqa: E402
from swarm.finetune.trainer import Finetuner, StepReport  # noqa: E402
from swarm.frontend.local import DiffusionLM  # noqa: E402
from swarm.models.loading import DEFAULT_MODEL, resolve_model_path  # noqa: E402
from swarm.train.data import AdditionTask  # noqa: E402
from swarm.utils.local_swarm import LocalSwarm  # noqa: E402

logger = logging.getLogger("finetune_addition")


@dataclass
class DemoConfig:
    """The run's settings (every flag of the command)."""

    model: str = DEFAULT_MODEL
    output: str = "finetune-addition"
    adapter_kind: str = BOTTLENECK
    prompt_length: int = 16
    rank: int = 32  # a bottleneck adapter's rank
    head_rank: int = 32  # the rank of the client's head correction (0: none)
    down_scale: Optional[float] = None  # the down projections' starting scale (None: the finetuner's default)
    max_grad_norm: Optional[float] = None  # clip each step's gradient to this norm (0: never; None: the default)
    lr_from: tuple[tuple[int, float], ...] = ()  # (step, lr): the learning rate from that step on
    lr: float = 0.003
    steps: int = 6000
    batch_size: int = 16
    pad_response: int = TaskGeneration.gen_length  # EOS-pad answers to the length generation will fill
    seed: int = 0
    train_examples: int = 20000
    eval_examples: int = 100
    timing_steps: int = 20
    swarm_check: int = 5
    threads: int = 1
    startup_timeout: float = 600.0  # seconds a swarm process may take to start (a busy machine is slow)
    resume: bool = False  # go on with the swarm training already in ``output`` (a long run over several sessions)


@dataclass
class DemoResult:
    config: DemoConfig
    model: dict[str, Any]
    before: dict[str, Any]
    after: dict[str, Any]
    swarm_step_s: float  # median wall-clock of a training step through the swarm (the first one left out)
    local_step_s: float  # the same, with every block in this process
    first_swarm_step_s: float  # route, compute challenges and connections included
    swarm_loss_final: Optional[float]  # mean loss of the last 10 steps through the swarm
    timing_loss_max_diff: float  # the timing steps' losses, swarm vs local
    swarm_check: dict[str, int] = field(default_factory=dict)  # held-out problems generated through the swarm too
    swarm_steps_timed: tuple[int, int] = (0, 0)  # the steps swarm_step_s is the median of (this session's)
    shape_before: dict[str, int] = field(default_factory=dict)  # answer_shape of the answers before and after
    shape_after: dict[str, int] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)


def write_pairs(task: AdditionTask, count: int, seed: int, path: Path) -> Path:
    """Training problems (never held-out ones) as prompt/response lines for ``swarm.finetune``."""
    lines = [json.dumps({"prompt": p.prompt, "response": p.answer}) for p in task.problems(count, seed, held_out=False)]
    path.write_text("\n".join(lines) + "\n")
    return path


def score(lm: Any, task: AdditionTask, examples: int, adapter: Optional[str] = None) -> TaskReport:
    options = {"adapter": adapter} if adapter else None
    return evaluate_task(lm, task, examples=examples, generate_options=options, keep=examples)


def answer_shape(samples: list[dict[str, str]]) -> dict[str, int]:
    """Finer than exact match, on the same answers: how many have the right number of digits, the right first
    digit, the right last digit (the units, which need no carry: chance is about 1 in 10)."""
    return {"length": sum(len(s["output"]) == len(s["answer"]) for s in samples),
            "first_digit": sum(s["output"][:1] == s["answer"][:1] for s in samples),
            "last_digit": sum(s["output"][-1:] == s["answer"][-1:] for s in samples)}


def median_after_first(reports: list[StepReport]) -> float:
    """NaN when no step ran (a resumed run that was already complete)."""
    seconds = [r.seconds for r in reports[1:]] or [r.seconds for r in reports]
    return statistics.median(seconds) if seconds else float("nan")


def timed_steps(reports: list[StepReport]) -> tuple[int, int]:
    """The first and last step :func:`median_after_first` covers (a resumed run times only this session's)."""
    timed = reports[1:] or reports
    return (timed[0].step, timed[-1].step) if timed else (0, 0)


def finetune(lm: Any, config: DemoConfig, data: Path, output: Path, steps: int) -> tuple[Finetuner, list[StepReport]]:
    trainer = Finetuner(lm, FinetuneConfig(str(data), str(output), steps=steps, lr=config.lr,
                                           batch_size=config.batch_size, prompt_length=config.prompt_length,
                                           adapter_kind=config.adapter_kind, rank=config.rank,
                                           head_rank=config.head_rank, down_scale=config.down_scale,
                                           max_grad_norm=config.max_grad_norm, lr_from=config.lr_from,
                                           seed=config.seed,
                                           pad_response=config.pad_response,
                                           save_every=max(10, steps // 10)))
    return trainer, trainer.run(progress=sys.stderr.isatty())


def halves(num_layers: int) -> tuple[str, str]:
    middle = num_layers // 2
    return f"0:{middle}", f"{middle}:{num_layers}"


def run(config: DemoConfig) -> DemoResult:
    torch.set_num_threads(config.threads)
    out = Path(config.output)
    out.mkdir(parents=True, exist_ok=True)
    # A rerun trains from scratch unless told to resume the swarm's run (the finetuner resumes bit for bit: the
    # same adapter as a run straight through; the data file is rewritten with the same bytes).
    for stale in ("local", "model") if config.resume else ("swarm", "local", "model"):
        shutil.rmtree(out / stale, ignore_errors=True)
    # one snapshot of the model for this process and every server: the files may be replaced during the run
    model_path = str(shutil.copytree(resolve_model_path(config.model), out / "model"))
    lm = DiffusionLM.from_pretrained(model_path)
    task = AdditionTask(tokenizer=lm.tokenizer)
    data = write_pairs(task, config.train_examples, config.seed, out / "addition.jsonl")
    wall: dict[str, float] = {}

    started = time.perf_counter()
    before = score(lm, task, config.eval_examples)
    wall["score_before"] = time.perf_counter() - started
    logger.info("before: %d/%d", before.correct, before.examples)

    with LocalSwarm(startup_timeout=config.startup_timeout) as swarm:
        swarm.start_bootstrap()
        servers = [swarm.start_server(model_path, span, "--compute-threads", str(config.threads), wait=False)
                   for span in halves(lm.config.num_layers)]
        for server in servers:
            swarm.wait_ready(server)
        from swarm.client import DistributedDiffusionLM

        client = DistributedDiffusionLM.from_pretrained(model_path, initial_peers=swarm.initial_peers,
                                                        request_timeout=60)
        try:
            started = time.perf_counter()
            trainer, swarm_reports = finetune(client, config, data, out / "swarm", config.steps)
            # the settings the run has (the kind's defaults, or a resumed run's own): the local run takes them too
            config.down_scale, config.max_grad_norm = trainer.config.down_scale, trainer.config.max_grad_norm
            wall["train_swarm"] = time.perf_counter() - started
            checked = out / "swarm"
            agree = 0
            for problem in task.problems(config.swarm_check, 0, held_out=True):
                ids = prompt_ids(lm, problem.prompt)
                settings = dict(asdict(TaskGeneration()), seed=0, adapter=str(checked))
                agree += client.generate(ids, **settings).token_ids == lm.generate(ids, **settings).token_ids
        finally:
            client.shutdown()

    started = time.perf_counter()
    _, local_reports = finetune(lm, config, data, out / "local", config.timing_steps)
    wall["train_local_timing"] = time.perf_counter() - started
    # the run's first losses (kept in its state, also when resumed) against the local ones of the same steps
    loss_diff = max((abs(a.loss - b) for a, b in zip(local_reports, trainer.state.losses)), default=0.0)

    started = time.perf_counter()
    after = score(lm, task, config.eval_examples, adapter=str(out / "swarm"))
    wall["score_after"] = time.perf_counter() - started
    model = {"name": config.model, "vocab_size": lm.config.vocab_size, "hidden_size": lm.config.hidden_size,
             "num_layers": lm.config.num_layers,
             "adapter_parameters": sum(p.numel() for p in trainer.adapter.parameters()),
             "servers": list(halves(lm.config.num_layers))}
    return DemoResult(config, model, asdict(before), asdict(after), median_after_first(swarm_reports),
                      median_after_first(local_reports),
                      swarm_reports[0].seconds if swarm_reports else float("nan"), trainer.smoothed_loss(),
                      loss_diff, {"agree": agree, "of": config.swarm_check}, wall_s=wall,
                      shape_before=answer_shape(before.samples), shape_after=answer_shape(after.samples),
                      swarm_steps_timed=timed_steps(swarm_reports))


def show(result: DemoResult) -> str:
    c, m = result.config, result.model
    first, last = result.swarm_steps_timed
    lines = [
        f"model {m['name']}: vocabulary {m['vocab_size']}, hidden {m['hidden_size']}, {m['num_layers']} blocks; "
        f"swarm: servers {' and '.join(m['servers'])} on 127.0.0.1",
        f"adapter: {c.adapter_kind}, "
        + (f"rank {c.rank}" if c.adapter_kind in RANKED_KINDS else f"{c.prompt_length} positions")
        + (f", head correction of rank {c.head_rank}" if c.head_rank else "")
        + (f", down projections x{c.down_scale}" if c.down_scale != 1.0 else "")
        + (f", gradient norm clipped at {c.max_grad_norm}" if c.max_grad_norm else "")
        + f", {m['adapter_parameters']} parameters; "
        f"{c.steps} steps, batch {c.batch_size}, lr {c.lr}"
        + "".join(f", {lr} from step {step}" for step, lr in c.lr_from)
        + f", answers padded to {c.pad_response}, "
        f"{c.train_examples} training problems, seed {c.seed}",
        "",
        "| held-out addition (exact match) | correct | accuracy |",
        "|---|---|---|",
        f"| backbone alone | {result.before['correct']}/{result.before['examples']} | "
        f"{result.before['accuracy']:.1%} |",
        f"| with the adapter trained through the swarm | {result.after['correct']}/{result.after['examples']} | "
        f"{result.after['accuracy']:.1%} |",
        "",
        "| the same answers | right length | right first digit | right last digit |",
        "|---|---|---|---|",
        *(f"| {label} | {shape['length']}/{n} | {shape['first_digit']}/{n} | {shape['last_digit']}/{n} |"
          for label, shape, n in (("backbone alone", result.shape_before, result.before["examples"]),
                                  ("with the adapter", result.shape_after, result.after["examples"]))),
        "",
        "| training step | wall-clock |",
        "|---|---|",
        f"| through the 2-server swarm (median of steps {first}-{last}) | {result.swarm_step_s:.3f} s |",
        f"| local, every block here (median of steps 2-{c.timing_steps}) | {result.local_step_s:.3f} s |",
        f"| first step through the swarm (route, challenges) | {result.first_swarm_step_s:.2f} s |",
        "",
        f"final loss (mean of the last 10 steps): {result.swarm_loss_final}; the first {c.timing_steps} steps' losses, "
        f"swarm vs local: max difference {result.timing_loss_max_diff:.2e}",
        f"same tokens through the swarm as locally with the adapter: {result.swarm_check['agree']}/"
        f"{result.swarm_check['of']} held-out problems",
        "samples after: " + "; ".join(f"{s['prompt']}{s['output']!r} (want {s['answer']})"
                                      for s in result.after["samples"][:5]),
        "wall-clock: " + ", ".join(f"{k} {v:.0f} s" for k, v in result.wall_s.items()),
    ]
    return "\n".join(lines)


def count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``, else a clear error naming the value."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value
    return parse


def parse_args(argv: Optional[list[str]] = None) -> tuple[DemoConfig, bool]:
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=defaults.model, help="Embedded model name or checkpoint directory.")
    parser.add_argument("--output", default=defaults.output,
                        help="Directory for the data, the adapters (swarm/, local/) and results.json.")
    parser.add_argument("--adapter-kind", choices=KINDS, default=defaults.adapter_kind, help="The adapter trained.")
    parser.add_argument("--prompt-length", type=count(1), default=defaults.prompt_length,
                        help="Prompt positions (the prompt kinds).")
    parser.add_argument("--rank", type=count(1), default=defaults.rank, help="A bottleneck's or LoRA's rank.")
    parser.add_argument("--head-rank", type=count(0), default=defaults.head_rank,
                        help="Rank of the head correction the client trains too (0: none).")
    parser.add_argument("--down-scale", type=float, default=defaults.down_scale,
                        help="Start the down projections at this many times unit scale (swarm.finetune --down-scale; "
                             "default: 4 for lora, else 1).")
    parser.add_argument("--max-grad-norm", type=float, default=defaults.max_grad_norm,
                        help="Clip each step's gradient to this norm (swarm.finetune --max-grad-norm; 0: never; "
                             "default: 1 for lora, else 0).")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="Adam learning rate.")
    parser.add_argument("--lr-from", action="append", default=[], metavar="STEP:LR",
                        help="The learning rate from step STEP on (repeatable; swarm.finetune --lr-from).")
    parser.add_argument("--steps", type=count(1), default=defaults.steps, help="Training steps through the swarm.")
    parser.add_argument("--batch-size", type=count(1), default=defaults.batch_size, help="Problems per step.")
    parser.add_argument("--pad-response", type=count(0), default=defaults.pad_response,
                        help="EOS-pad every training answer to this many tokens (the evaluation's gen_length).")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="Seeds the problems, vectors and batches.")
    parser.add_argument("--train-examples", type=count(1), default=defaults.train_examples,
                        help="Training problems (none of them held out).")
    parser.add_argument("--eval-examples", type=count(1), default=defaults.eval_examples,
                        help="Held-out problems scored before and after.")
    parser.add_argument("--timing-steps", type=count(1), default=defaults.timing_steps,
                        help="Local training steps timed against the swarm's (same seed: same first losses).")
    parser.add_argument("--swarm-check", type=count(0), default=defaults.swarm_check,
                        help="Held-out problems also generated through the swarm with the adapter (same tokens?).")
    parser.add_argument("--threads", type=count(1), default=defaults.threads,
                        help="Torch threads of this process and of each server.")
    parser.add_argument("--startup-timeout", type=float, default=defaults.startup_timeout,
                        help="Seconds the bootstrap peer and each server may take to start.")
    parser.add_argument("--resume", action="store_true",
                        help="Go on with the swarm training already in --output up to --steps (same flags, or an "
                             "--lr-from for steps not taken yet), instead of starting again: a long run split over "
                             "sessions. Step timings cover this session.")
    parser.add_argument("--json", action="store_true", help="Print the results as JSON instead of tables.")
    args = vars(parser.parse_args(argv))
    as_json = args.pop("json")
    try:  # the finetuner's own checks, before anything runs
        args["lr_from"] = parse_lr_from(args["lr_from"])
        FinetuneConfig("", "", down_scale=args["down_scale"], max_grad_norm=args["max_grad_norm"])
    except ValueError as error:
        parser.error(str(error))
    return DemoConfig(**args), as_json


def main(argv: Optional[list[str]] = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config, as_json = parse_args(argv)
    result = run(config)
    (Path(config.output) / "results.json").write_text(json.dumps(asdict(result), indent=2, default=str))
    sys.stdout.write((json.dumps(asdict(result), indent=2, default=str) if as_json else show(result)) + "\n")


if __name__ == "__main__":
    main()
