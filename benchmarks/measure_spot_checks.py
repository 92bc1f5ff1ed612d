"""Measure spot checks: how often a liar is caught over repeated runs, and the wall-time overhead.

    python benchmarks/measure_spot_checks.py [--runs 10] [--overhead]

Starts, for a tiny 4-block model on 127.0.0.1, two honest servers and the test-only faulty server
(tests/faulty_server.py) in its 1-in-20 mode (it lies on a random one in 20 of its answers), announcing itself as
the fastest. For spot-check fractions 0.05, 0.25 and 1.0 it runs fresh clients with default settings (each draws
its own check schedule from os.urandom) and reports how often and how early the liar was caught, and whether the
tokens equal the honest local run. Then it replaces them with a ``--head`` server that lies only in its
predictions beside one honest replica without the head, and reports at fraction 1.0 whether it is caught. With
``--overhead`` it first measures the wall time of checks on the honest servers alone.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, when run as a script

from swarm.client import DistributedDiffusionLM  # noqa: E402
from swarm.client.failover import RetriesExhausted  # noqa: E402
from swarm.frontend.local import DiffusionLM  # noqa: E402
from swarm.testing.checkpoints import make_checkpoint, tiny_config  # noqa: E402
from swarm.utils.local_swarm import LocalSwarm  # noqa: E402

FAULTY = (str(ROOT / "tests" / "faulty_server.py"),)  # run as a script: the test-only lying server
SETTINGS = dict(gen_length=32, steps=32, block_length=16, seed=1, temperature=0.5)
FRACTIONS = (0.05, 0.25, 1.0)


def run_once(swarm: LocalSwarm, path: Path, liar: str, fraction: float, expected: list[int]) -> tuple:
    """One fresh client's generation: (first step the liar was caught at or None, tokens honest, error)."""
    with DistributedDiffusionLM.from_pretrained(path, initial_peers=swarm.initial_peers,
                                                spot_check_fraction=fraction) as lm:
        try:
            result = lm.generate("audit", **SETTINGS)
        except RetriesExhausted as error:
            return None, False, str(error)[:80]
        caught = [o.step for o in lm.sequence.spot_checker.outcomes
                  if o.verdict == "primary_faulty" and o.primary == liar]
        return (caught[0] if caught else None), result.token_ids == expected, ""


def detection(swarm: LocalSwarm, path: Path, liar: str, fraction: float, runs: int, expected: list[int]) -> str:
    """A table row: caught in k of ``runs``, first caught at which steps, honest tokens in how many."""
    outcomes = [run_once(swarm, path, liar, fraction, expected) for _ in range(runs)]
    caught = [step for step, _, _ in outcomes if step is not None]
    errors = [error for _, _, error in outcomes if error]
    return (f"| {fraction} | {len(caught)}/{runs} | {', '.join(map(str, caught)) or '-'} | "
            f"{sum(honest for _, honest, _ in outcomes)}/{runs} |" + (f" errors: {errors}" if errors else ""))


def overhead(swarm: LocalSwarm, path: Path) -> None:
    """Median wall time of a generation with checks at several fractions, on honest servers only."""
    def timed(fraction: float) -> float:
        with DistributedDiffusionLM.from_pretrained(path, initial_peers=swarm.initial_peers,
                                                    spot_check_fraction=fraction) as lm:
            lm.generate("warm", gen_length=16, steps=4, block_length=16)
            return statistics.median(lm.generate("audit", **SETTINGS).elapsed_s for _ in range(3))

    base = timed(0.0)
    print(f"overhead on honest servers ({SETTINGS['steps']} steps, median of 3):")
    for fraction in (0.25, 1.0):
        seconds = timed(fraction)
        print(f"  fraction {fraction:<5} {seconds:6.2f} s  ({seconds / base:.2f}x of {base:.2f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="Clients per spot-check fraction.")
    parser.add_argument("--overhead", action="store_true", help="Also measure the wall time of checks.")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm() as swarm:
        path = make_checkpoint(Path(tmp) / "audited", tiny_config(num_layers=4), seed=9)
        expected = DiffusionLM.from_pretrained(path).generate("audit", **SETTINGS).token_ids
        swarm.start_bootstrap()
        honest = [swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--throughput", "1", wait=False)
                  for _ in range(2)]
        for server in honest:
            swarm.wait_ready(server)
        if args.overhead:
            overhead(swarm, path)
        liar = swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--throughput", "1e9",
                                  "--public-name", "faulty-1in20", entry=FAULTY, name="faulty-1in20")
        print(f"\n1-in-20 liar among 2 honest replicas, {SETTINGS['steps']} steps, {args.runs} runs per fraction:")
        print("| spot-check fraction | caught | first caught at step | tokens equal the honest run |")
        print("|---|---|---|---|")
        for fraction in FRACTIONS:
            print(detection(swarm, path, liar.peer_id, fraction, args.runs, expected), flush=True)
        for server in (*honest, liar):
            swarm.terminate(server)

        head_liar = swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--throughput", "1e9", "--head",
                                       "--public-name", "faulty-head", entry=FAULTY, name="faulty-head", wait=False)
        replica = swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--throughput", "1", wait=False)
        for server in (head_liar, replica):
            swarm.wait_ready(server)
        print(f"\nlying --head server beside one replica without the head, {args.runs} runs:")
        print("| spot-check fraction | caught | first caught at step | tokens equal the honest run |")
        print("|---|---|---|---|")
        print(detection(swarm, path, head_liar.peer_id, 1.0, args.runs, expected), flush=True)


if __name__ == "__main__":
    main()
