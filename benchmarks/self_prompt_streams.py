"""Two domains teaching themselves at once from seed examples only (docs/TRAINING.md, "The swarm teaches itself").

A local swarm's bootstrap peer and one ``python -m swarm.improve --self-prompt N`` trainer per domain (tagged and
bracketed addition), each from ``--seeds`` seed examples of its domain and nothing else: its first round trains on
the seeds, every later round on what it proposed, answered and its domain's checker accepted. Each round's row: the
trainer's own figure on its fixed held-out problems (disjoint from everything it can propose: a hash partition,
checked by the held-out guard), the score of its newest published version on fresh held-out problems drawn after the
run (the auditor's method, ``swarm.audit``'s ``evaluate_task`` on ``os.urandom`` seeds, run here on the local model),
and the round's self-prompting record (proposed, new, accepted, acceptance).

    python benchmarks/self_prompt_streams.py --output teach --rounds 5

Writes ``streams.md`` and ``streams.json`` (and ``streams.png`` where matplotlib is installed) to ``--output``.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from swarm.improve.demo import round_of, stop, write_seeds

DOMAINS = ("tagged-addition", "bracketed-addition")
HEADER = ("| round | stream | own held-out figure | newest version: fresh held-out score | proposed | by the model "
          "| new | held out | accepted | acceptance |\n|---|---|---|---|---|---|---|---|---|---|")


def row(number: int, domain: str, entry: dict[str, Any]) -> str:
    prompted = entry.get("self_prompt") or {}
    cells = [prompted.get(k, "-") for k in ("proposed", "by_model", "new", "held_out", "accepted")]
    rate, fresh = prompted.get("acceptance"), entry.get("fresh")
    rule = "" if entry.get("rule") is None else f" (the rule: {entry['rule']:.2f})"
    return (f"| {number} | {domain} | {entry['figure']:.2f} | "
            + ("-" if fresh is None else f"v{entry['newest']}: {fresh:.2f}{rule}") + " | " + " | ".join(map(str, cells))
            + f" | {'-' if rate is None else f'{rate:.2f}'} |")


def score_versions(work: Path, domain: str, history: list[dict[str, Any]], examples: int) -> None:
    """Add to each round the newest published version and its exact match on fresh held-out problems."""
    import os

    from swarm.eval.tasks import evaluate_task
    from swarm.frontend.local import DiffusionLM
    from swarm.train.data import TASKS

    lm = DiffusionLM.from_pretrained("addition")
    scores: dict[int, float] = {}
    rules: dict[int, float] = {}
    newest = None
    for entry in history:
        newest = entry["version"] or newest
        if newest is not None and newest not in scores:
            seed = int.from_bytes(os.urandom(4), "big") >> 1
            task = TASKS[domain]()
            report = evaluate_task(lm, task, examples=examples, seed=seed,
                                   generate_options={"adapter": str(work / "trainer" / "versions" / str(newest))})
            scores[newest] = report.correct / report.examples
            if hasattr(task, "rule"):  # a domain with a built-in answer (host-blocks): scored on the same problems
                problems = task.problems(examples, seed, held_out=True)
                rules[newest] = sum(task.check(p.prompt, task.rule(p.prompt)) for p in problems) / len(problems)
        entry["newest"], entry["fresh"], entry["rule"] = newest, scores.get(newest), rules.get(newest)


def plot(histories: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for domain, history in histories.items():
        rounds = [entry["round"] for entry in history]
        axes.plot(rounds, [entry["figure"] for entry in history], "o-", label=f"{domain}: held-out figure")
        axes.plot(rounds, [(entry.get("self_prompt") or {}).get("acceptance", float("nan")) for entry in history],
                  "s:", label=f"{domain}: accepted answers / new problems")
    axes.set_xlabel("round (round 1 trains on the seeds alone)")
    axes.set_ylim(-0.02, 1.02)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


@click.command()
@click.option("--output", default="teach", type=click.Path(file_okay=False))
@click.option("--domain", "domains", multiple=True, default=DOMAINS, help="A stream's task (repeatable).")
@click.option("--rounds", type=click.IntRange(1, 50), default=5)
@click.option("--seeds", type=click.IntRange(1, 1000), default=8, help="Seed examples per domain (the human data).")
@click.option("--proposals", type=click.IntRange(1, 10_000), default=48, help="Problems proposed per round.")
@click.option("--round-steps", type=click.IntRange(1), default=20)
@click.option("--held-out", type=click.IntRange(1), default=40)
@click.option("--fresh", type=click.IntRange(1), default=60, help="Fresh held-out problems per published version.")
@click.option("--round-timeout", type=float, default=900.0)
def main(output: str, domains: tuple[str, ...], rounds: int, seeds: int, proposals: int, round_steps: int,
         held_out: int, fresh: int, round_timeout: float) -> None:
    from swarm.governance.keys import generate_private_key
    from swarm.utils.local_swarm import LocalSwarm

    out = Path(output)
    started = time.perf_counter()
    trainers = {}
    with LocalSwarm(fork_server=True) as swarm:
        swarm.start_bootstrap()
        peers = [arg for peer in swarm.initial_peers for arg in ("--initial-peers", peer)]
        try:
            for domain in domains:
                work = out / domain
                write_seeds(work / "data", domain, seeds)
                generate_private_key(work / "trainer.key")
                command = ["-m", "swarm.improve", "--task", domain, "--data", str(work / "data"), "--name", domain,
                           "--key", str(work / "trainer.key"), "--workdir", str(work / "trainer"), "--model",
                           "addition", "--rounds", str(rounds), "--round-steps", str(round_steps), "--held-out",
                           str(held_out), "--self-prompt", str(proposals), "--keep", "16", "--local-model",
                           "--threads", "1", *peers]
                trainers[domain] = swarm.start_command(domain, command, log=work / "trainer.log").process
            for number in range(1, rounds + 1):
                for domain, process in trainers.items():
                    deadline = time.monotonic() + round_timeout
                    while round_of(out / domain / "trainer")[0] < number:
                        if process.poll() is not None or time.monotonic() > deadline:
                            raise RuntimeError(f"{domain} stopped before round {number}: see its trainer.log")
                        time.sleep(0.5)
                click.echo(f"round {number} done ({time.perf_counter() - started:.0f} s)")
        finally:
            stop(list(trainers.values()))
    histories = {domain: round_of(out / domain / "trainer")[1] for domain in domains}
    for domain, history in histories.items():
        score_versions(out / domain, domain, history, fresh)
    lines = [HEADER] + [row(entry["round"], domain, entry) for domain in domains for entry in histories[domain]]
    (out / "streams.md").write_text("\n".join(lines) + "\n")
    (out / "streams.json").write_text(json.dumps(histories, indent=1))
    try:
        plot(histories, out / "streams.png")
    except ImportError:
        click.echo("matplotlib is not installed: no plot")
    click.echo("\n".join(lines))
    click.echo(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
