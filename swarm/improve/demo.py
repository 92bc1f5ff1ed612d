"""``python -m swarm.improve.demo``: the self-improving loop on one machine, with a curve.

A local swarm (one server of the embedded ``addition`` model, which the others join through), two trainers of one
run id (``python -m swarm.improve`` subprocesses, each publishing versions under its own key), one auditor scoring
every new version on fresh held-out problems, and a client that asks for ``adapter="best:TASK"`` and is scored on
fresh held-out problems of its own. Nobody chooses: the trainers publish when their own figure improves, the auditor
measures, the client's ``best:`` moves by the trusted measurements (``swarm.reports.adoption``). The task is
``tagged-addition`` (addition answered with a trailing ``!``, which the base model never writes: 0 before any
adapter), so the curve is drawn in minutes on 2 cores. The trainers' data source is a folder that grows: each round
starts when :data:`EXAMPLES_PER_ROUND` new examples arrive (``--min-new-examples``), which the demonstration writes
after scoring the previous round, so the rows line up (the trainers would otherwise run ahead of the auditor).

Prints a table per round (round, version chosen, the trainers' own figures, the auditor's figure of the chosen
version, what ``best:`` chose, the client's score) and writes it, as Markdown and JSON, with a PNG plot of the curve
(``matplotlib``: the ``plot`` extra) to ``--output``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import click

from swarm.cli.options import run_main, setup_logging
from swarm.utils.extras import install_hint
from swarm.utils.forkserver import TRAINING_PRELOAD, ForkedProcess

logger = logging.getLogger(__name__)

TASK = "tagged-addition"  # swarm.train.data.TaggedAdditionTask (imported when run: it loads torch)
NAME = "tagged"
MODEL = "addition"
EXAMPLES_PER_ROUND = 100  # examples arriving in the trainers' data folder each round (a round starts on new data)
Process = Union[subprocess.Popen, ForkedProcess]  # a trainer (LocalSwarm.start_command)


@dataclass
class Row:
    round: int
    newest: dict[str, str]  # each trainer's newest live version ("v3"; "-": none yet)
    trainer_figures: dict[str, float]  # each trainer's own held-out figure this round
    auditor_figures: dict[str, Optional[float]]  # the auditor's latest score of each trainer's newest version
    best: str  # what best:TASK chose (trainer:version)
    chosen_figure: Optional[float]  # the auditor's latest score of the chosen version
    client_score: float  # the client's held-out score, generating with best:TASK (fresh problems each round)
    moved: bool  # best:TASK moved this round

    def line(self) -> str:
        def shown(values: dict[str, Any]) -> str:
            return " / ".join("-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))
                              for v in values.values()) or "-"

        chosen = "-" if self.chosen_figure is None else f"{self.chosen_figure:.2f}"
        return (f"| {self.round} | {shown(self.newest)} | {shown(self.trainer_figures)} | "
                f"{shown(self.auditor_figures)} | {self.best}{' (moved)' if self.moved else ''} | {chosen} | "
                f"{self.client_score:.2f} |")


HEADER = ("| round | newest version (A / B) | trainers' own figure (A / B) | auditor's figure (A / B) "
          "| best:TASK chose | auditor's figure of the choice | client's held-out score |\n"
          "|---|---|---|---|---|---|---|")


def write_examples(path: Path, count: int, seed: int, task: str = TASK) -> None:
    """``count`` training problems of ``task`` (none held out) as JSONL, as every data source reads them."""
    from swarm.train.data import TASKS

    problems = TASKS[task]().problems(count, seed, held_out=False)
    path.write_text("".join(json.dumps({"prompt": p.prompt, "response": p.answer}) + "\n" for p in problems))


def write_seeds(folder: Path, task: str, count: int, seed: int = 7) -> None:
    """A self-prompting stream's human data: ``count`` seed examples of ``task`` in ``folder/seeds.jsonl``."""
    folder.mkdir(parents=True, exist_ok=True)
    write_examples(folder / "seeds.jsonl", count, seed, task)


def round_of(workdir: Path) -> tuple[int, list[dict[str, Any]]]:
    try:
        state = json.loads((workdir / "improve.json").read_text())
    except (OSError, json.JSONDecodeError):
        return 0, []
    return state["round"], state["history"]


def plot(rows: list[Row], path: Path) -> None:
    """The curve: the client's score, the auditor's figure of the chosen version, the trainers' own figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r.round for r in rows]
    labels = list(rows[-1].trainer_figures)
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(rounds, [r.client_score for r in rows], "o-", linewidth=2.5, label="client (best:TASK, fresh problems)")
    axes.plot(rounds, [r.chosen_figure if r.chosen_figure is not None else float("nan") for r in rows], "s--",
              label="auditor's figure of the chosen version")
    for index, name in enumerate(labels):
        axes.plot(rounds, [r.trainer_figures.get(name, float("nan")) for r in rows], ":", marker="^^v"[index % 3],
                  label=f"trainer {name}'s own figure")
    axes.set_xlabel("round")
    axes.set_ylabel("held-out exact match")
    axes.set_ylim(-0.02, 1.02)
    axes.set_xticks(rounds)
    axes.set_title(f"swarm self-improvement: {TASK} (2 trainers, 1 auditor, 1 client)")
    axes.legend(loc="upper left", fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def start_trainer(swarm, peers: list[str], label: str, workdir: Path, key: Path, data: Path, options: dict[str, Any],
                  log: Path) -> Process:
    """A ``python -m swarm.improve`` process of the local swarm (forked from its fork server) joining through
    ``peers``, its output in ``log``."""
    command = ["-m", "swarm.improve", "--task", TASK, "--data", str(data), "--name", NAME,
               "--key", str(key), "--workdir", str(workdir), "--model", MODEL, "--run-id", "demo",
               "--rounds", "0", "--round-steps", str(options["round_steps"]),
               "--held-out", str(options["held_out"]), "--batch-size", str(options["batch_size"]),
               "--target-batch-size", str(2 * options["batch_size"]), "--keep", "2", "--threads", "1",
               "--min-new-examples", str(EXAMPLES_PER_ROUND),
               "--log-level", "INFO", *[arg for peer in peers for arg in ("--initial-peers", peer)],
               *(["--local-model"] if options["local_model"] else [])]
    return swarm.start_command(f"trainer {label}", command, log=log).process


def stop(processes: list[Process]) -> None:
    """SIGTERM to every process at once (each takes seconds to leave its collaboration), then wait for each."""
    running = [process for process in processes if process.poll() is None]
    for process in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    for process in running:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def run_demo(output: Path, rounds: int, round_steps: int, held_out: int, audit_examples: int, client_examples: int,
             batch_size: int, local_model: bool, round_timeout: float, margin: float = 0.1) -> list[Row]:
    """Run the demonstration; the table's rows (also written to ``output``)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from swarm.adapters.adapter import AdapterError
    from swarm.audit.auditor import Auditor
    from swarm.audit.config import AuditorConfig
    from swarm.client import DistributedDiffusionLM
    from swarm.dht.config import NetworkConfig
    from swarm.dht.validation import ed25519_text
    from swarm.eval.tasks import evaluate_task
    from swarm.governance.keys import generate_private_key
    from swarm.models.loading import ModelFiles
    from swarm.train.data import TaggedAdditionTask
    from swarm.utils.local_swarm import LocalSwarm

    # A private swarm of this machine's own processes: nobody to price out of the shared lists, while the default
    # stamp (swarm.dht.stamp) would cost each trainer's first publish about a minute.
    os.environ.setdefault("SWARM_STAMP_BITS", "16")
    output.mkdir(parents=True, exist_ok=True)
    work = output / "work"
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    write_examples(data / "part-01.jsonl", EXAMPLES_PER_ROUND, seed=1)
    keys = {label: generate_private_key(work / f"trainer-{label}.key") for label in "AB"}
    auditor_key = Ed25519PrivateKey.generate()
    options = dict(round_steps=round_steps, held_out=held_out, batch_size=batch_size,
                   local_model=local_model)
    rows: list[Row] = []
    trainers: dict[str, Process] = {}
    # Every process forked from one that imported torch and hivemind, and torch._dynamo: torch.optim imports it when
    # an optimizer is made, 1.4 CPU s in each trainer.
    with LocalSwarm(fork_server=True, preload=TRAINING_PRELOAD) as swarm:
        # The server starts the swarm and everyone joins through it: a bootstrap peer would be one more DHT peer for
        # every record to reach (the trainers' progress records several times a second while they train).
        peers = swarm.start_server(MODEL, "0:4", "--compute-threads", "1").maddrs
        network = NetworkConfig(initial_peers=peers, client_mode=True)
        try:
            for label in "AB":
                trainers[label] = start_trainer(swarm, peers, label, work / f"trainer-{label}",
                                                work / f"trainer-{label}.key", data, options,
                                                work / f"trainer-{label}.log")
            auditor = Auditor(AuditorConfig(network=network, score_adapters=(TASK,), task_examples=audit_examples,
                                            fresh_identity=False, once=True), auditor_key, ModelFiles(MODEL))
            client = DistributedDiffusionLM.from_pretrained(MODEL, initial_peers=peers, route_refresh=2.0,
                                                            adoption_margin=margin,
                                                            trusted_auditors=(ed25519_text(auditor_key),))
            client.adapter_cache = work / "client-cache"
            task = TaggedAdditionTask()
            base = evaluate_task(client, task, examples=client_examples, seed=1000)
            rows.append(Row(0, {}, {}, {}, "-", None, base.correct / base.examples, False))
            click.echo(HEADER + "\n" + rows[-1].line())
            held = None
            for number in range(1, rounds + 1):
                histories = wait_for_round(trainers, work, number, round_timeout)
                auditor.run_round()
                try:
                    chosen = client.best_adapter(TASK)
                    scored = evaluate_task(client, task, examples=client_examples, seed=1000 + number,
                                           generate_options={"adapter": f"best:{TASK}"})
                    score = scored.correct / scored.examples
                    audited = audited_figure(client, TASK)
                except AdapterError as error:  # nothing audited yet: the client generates without an adapter
                    logger.info("round %d: best:%s has nothing yet (%s)", number, TASK, error)
                    chosen, audited = "-", None
                    plain = evaluate_task(client, task, examples=client_examples, seed=1000 + number)
                    score = plain.correct / plain.examples
                figures = {label: history[number - 1]["figure"] for label, history in histories.items()}
                newest, audited_newest = newest_versions(client, keys)
                rows.append(Row(number, newest, figures, audited_newest, short(chosen, keys), audited, score,
                                held is not None and chosen != held))
                held = chosen
                if number < rounds:  # new examples arrive in the trainers' data folder: their next round starts
                    write_examples(data / f"part-{number + 1:02d}.jsonl", EXAMPLES_PER_ROUND, seed=number + 1)
                click.echo(rows[-1].line())
            auditor.shutdown()
            client.shutdown()
        finally:
            stop(list(trainers.values()))
    click.echo(write_outputs(output, rows))  # what was written, and the install line of a plot that was not
    return rows


def short(reference: str, keys: dict[str, Any]) -> str:
    """``name@AUTHOR@VERSION`` with the author shown as the trainer's label (A, B)."""
    from swarm.adapters.sharing import author_id
    from swarm.dht.validation import ed25519_text

    labels = {author_id(ed25519_text(key)): label for label, key in keys.items()}
    parts = reference.split("@")
    if len(parts) == 3 and parts[1] in labels:
        return f"{parts[0]}@{labels[parts[1]]}:v{parts[2]}"
    return reference


def newest_versions(client, keys: dict[str, Any]) -> tuple[dict[str, str], dict[str, Optional[float]]]:
    """Each trainer's newest live version of the name, and the auditor's latest score of it."""
    from swarm.adapters.versions import read_versions
    from swarm.dht.validation import ed25519_text, signer_id

    authors = [signer_id(ed25519_text(key)) for key in keys.values()]
    lists = {listed.author: listed for listed in read_versions(client.dht, client.prefix, NAME, authors)}
    scores = client.planner.audits.adapter_scores()
    newest, audited = {}, {}
    for label, key in keys.items():
        latest = lists.get(ed25519_text(key))
        latest = latest.latest if latest is not None else None
        newest[label] = f"v{latest.number}" if latest is not None else "-"
        entry = scores.get((latest.sha256, TASK)) if latest is not None else None
        audited[label] = entry[1].score if entry is not None else None
    return newest, audited


def audited_figure(client, task: str) -> Optional[float]:
    """The trusted score of the version ``best:task`` holds now."""
    held = client.best_adapters.get(task)
    if held is None:
        return None
    entry = client.planner.audits.adapter_scores().get((held[2], task))
    return entry[1].score if entry is not None else None


def wait_for_round(trainers: dict[str, Process], work: Path, number: int, timeout: float
                   ) -> dict[str, list[dict[str, Any]]]:
    """Each trainer's history once every one has finished round ``number``; RuntimeError if one died or timed out."""
    deadline = time.monotonic() + timeout
    while True:
        states = {label: round_of(work / f"trainer-{label}") for label in trainers}
        if all(done >= number for done, _ in states.values()):
            return {label: history for label, (_, history) in states.items()}
        for label, process in trainers.items():
            if process.poll() is not None and states[label][0] < number:
                raise RuntimeError(f"trainer {label} exited ({process.returncode}) before round {number}; see "
                                   f"{work / f'trainer-{label}.log'}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"round {number} took over {timeout:.0f} s")
        time.sleep(0.25)  # a round's end is a file written: read it soon after


def write_report(output: Path, stem: str, table: str, data: Any, draw: Callable[[Path], None]) -> str:
    """Write ``stem``.md (the table) and ``stem``.json (``data``) to ``output``, and with matplotlib ``stem``.png
    (``draw(path)``); says what was written, and the install line of a plot that was not."""
    output.mkdir(parents=True, exist_ok=True)
    written = [output / f"{stem}.md", output / f"{stem}.json"]
    written[0].write_text(table)
    written[1].write_text(json.dumps(data, indent=1))
    try:
        draw(output / f"{stem}.png")
    except ImportError:  # the plot extra is optional: the table is the result, the plot a picture of it
        return f"wrote {', '.join(map(str, written))}; no plot (matplotlib is not installed: {install_hint('plot')})"
    return f"wrote {', '.join(map(str, [*written, output / f'{stem}.png']))}"


def write_outputs(output: Path, rows: list[Row]) -> str:
    """Write the table (Markdown, JSON) and, with matplotlib, the plot; says what was written (and what was not)."""
    table = "\n".join([HEADER, *(row.line() for row in rows)]) + "\n"
    return write_report(output, "improve_demo", table, [asdict(row) for row in rows], lambda path: plot(rows, path))


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--output", default="improve-demo", type=click.Path(file_okay=False),
              help="Where the table (Markdown, JSON), the plot and the runs' files go.")
@click.option("--rounds", type=click.IntRange(1, 100), default=6, help="Rounds of the loop.")
@click.option("--round-steps", type=click.IntRange(min=1), default=20, help="Optimizer steps per round.")
@click.option("--held-out", type=click.IntRange(min=1), default=40, help="Problems of the trainers' own figure.")
@click.option("--audit-examples", type=click.IntRange(min=1), default=60,
              help="Fresh held-out problems per version the auditor scores each round.")
@click.option("--client-examples", type=click.IntRange(min=1), default=60,
              help="Fresh held-out problems the client is scored on each round.")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, help="Each trainer's batch.")
@click.option("--margin", type=click.FloatRange(0, 1), default=0.1,
              help="The client's adoption margin: best:TASK moves only to a version audited better by this much.")
@click.option("--local-model", is_flag=True, help="Trainers run the model in their own process instead of through "
              "the server (faster on a loaded machine; the loop is the same).")
@click.option("--round-timeout", type=click.FloatRange(min=10), default=900.0,
              help="Seconds a round may take before the demonstration gives up.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING"]), default="WARNING",
              help="Logging verbosity.")
def main(output: str, log_level: str, **options) -> None:
    """Run the self-improving loop with two trainers, an auditor and a client, and print its table."""
    setup_logging(getattr(logging, log_level))
    started = time.perf_counter()
    rows = run_demo(Path(output), **options)
    rise = rows[-1].client_score - rows[0].client_score
    click.echo(f"client's held-out score {rows[0].client_score:.2f} -> {rows[-1].client_score:.2f} ({rise:+.2f}) "
               f"in {len(rows) - 1} rounds, {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    run_main(main)
