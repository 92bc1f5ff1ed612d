"""A trainer moved between two streams by a coordinator as the weights change (docs/TRAINING.md, "Stream records").

A local swarm's bootstrap peer, one ``python -m swarm.improve --stream-coordinator KEY`` trainer offering two streams
(``tagged``: tagged addition, its own; ``hosts``: host-blocks, ``--also-stream``) with ``--local-model`` on the
embedded addition model, and ``python -m swarm.improve coordinate`` publishing a record every 2 s with the trainer's
node given (``--node``). The weights start at 1:1 (the tie gives the node to ``hosts``); once the trainer's first
round ends the coordinator is restarted with 3:1 (the node goes to ``tagged``). Prints which stream each round
trained, the moves the trainer logged, and the coordinator's distinct lines (pools, and the flags it raised).

    python benchmarks/stream_follow.py --output follow --rounds 4 --round-steps 40

Logs stay in ``--output`` (``trainer.log``, ``coordinator.log``).
"""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import click

from swarm.improve.demo import write_seeds


def coordinator(out: Path, peers: list[str], node: str, weights: tuple[float, float]) -> subprocess.Popen:
    args = [sys.executable, "-m", "swarm.improve", "coordinate", *[a for p in peers for a in ("--initial-peers", p)],
            "--model", "addition", "--key", str(out / "coordinator.key"), "--stream",
            f"tagged:tagged-addition:{weights[0]:g}", "--stream", f"hosts:host-blocks:{weights[1]:g}", "--node", node,
            "--trusted-auditors", "none", "--every", "2"]
    return subprocess.Popen(args, stdout=open(out / "coordinator.log", "a"), stderr=subprocess.STDOUT)


def wait_for(path: Path, pattern: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and re.search(pattern, path.read_text()):
            return True
        time.sleep(1)
    return False


@click.command()
@click.option("--output", type=click.Path(file_okay=False), required=True)
@click.option("--rounds", type=click.IntRange(2, 20), default=4, help="The trainer's rounds in all.")
@click.option("--round-steps", type=click.IntRange(1), default=40)
@click.option("--timeout", type=float, default=900.0, help="Seconds the whole run may take.")
def main(output: str, rounds: int, round_steps: int, timeout: float) -> None:
    from swarm.dht.identity import Identity
    from swarm.governance.keys import generate_private_key, public_key_text
    from swarm.utils.local_swarm import LocalSwarm

    out, started = Path(output), time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    write_seeds(out / "seeds-t", "tagged-addition", 16)
    write_seeds(out / "seeds-hb", "host-blocks", 16)
    generate_private_key(out / "trainer.key")
    (out / "coordinator.key.pub").write_text(public_key_text(generate_private_key(out / "coordinator.key")))
    (out / "node").mkdir(exist_ok=True)
    node = Identity.load_or_create(out / "node" / "identity.key").peer_id  # the trainer's peer id, known beforehand
    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        peers = swarm.initial_peers
        coordinating = coordinator(out, peers, node, (1, 1))
        try:
            wait_for(out / "coordinator.log", "hosts: weight 1, 1 nodes", 120)
            trainer = swarm.start_command("trainer", [
                "-m", "swarm.improve", "--task", "tagged-addition", "--data", str(out / "seeds-t"), "--name", "tagged",
                "--key", str(out / "trainer.key"), "--workdir", str(out / "node"), "--local-model", "--model",
                "addition", "--rounds", str(rounds), "--round-steps", str(round_steps), "--held-out", "4",
                "--threads", "1", *[a for p in peers for a in ("--initial-peers", p)],
                "--stream-coordinator", str(out / "coordinator.key.pub"),
                "--also-stream", f"hosts:host-blocks:{out / 'seeds-hb'}"], log=out / "trainer.log")
            wait_for(out / "trainer.log", r"round 1:", timeout)
            coordinating.terminate()
            coordinating.wait(30)
            click.echo(f"{time.monotonic() - started:.0f} s: weights 3:1")
            coordinating = coordinator(out, peers, node, (3, 1))
            while trainer.alive and time.monotonic() - started < timeout:
                time.sleep(2)
        finally:
            coordinating.terminate()
            coordinating.wait(30)
    log = (out / "trainer.log").read_text()
    for line in log.splitlines():
        if "swarm.improve.follow" in line or re.search(r"swarm\.improve\.loop: round \d+:", line):
            click.echo(line.split(" INFO ")[-1][:160])
    click.echo("coordinator's records (distinct lines, in order):")
    seen: list[str] = []
    for line in (out / "coordinator.log").read_text().splitlines():
        if line.startswith("tagged:") and line not in seen:
            seen.append(line)
            click.echo(f"  {line}")
    click.echo(f"{time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    main()
