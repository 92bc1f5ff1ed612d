"""Measure spot checks: detection of a faulty server over repeated runs, and the wall-time overhead.

    python tests/measure_spot_checks.py [--runs 5]

Starts two honest servers and the test-only faulty server (tests/faulty_server.py, announcing itself as
the fastest) for a tiny model on 127.0.0.1, then for several spot-check fractions runs fresh clients with
different spot-check seeds and reports how often and how early the faulty server was caught, and whether
the tokens equal the honest local run. The overhead is measured on the honest servers alone.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.client import DistributedDiffusionLM  # noqa: E402
from swarm.local import DiffusionLM  # noqa: E402
from swarm.utils.local_swarm import LocalSwarm  # noqa: E402
from tests.conftest import make_checkpoint, tiny_config  # noqa: E402

FAULTY = (str(Path(__file__).with_name("faulty_server.py")),)
SETTINGS = dict(gen_length=32, steps=32, block_length=16, seed=1, temperature=0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="Clients per spot-check fraction.")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm() as swarm:
        path = make_checkpoint(Path(tmp) / "audited", tiny_config(num_layers=4), seed=9)
        expected = DiffusionLM.from_pretrained(path).generate("audit", **SETTINGS).token_ids
        swarm.start_bootstrap()
        honest = [swarm.start_server(str(path), "0:4", "--compute-threads", "1", wait=False) for _ in range(2)]
        for server in honest:
            swarm.wait_ready(server)

        def timed(fraction: float) -> float:
            with DistributedDiffusionLM.from_pretrained(path, initial_peers=swarm.initial_peers,
                                                        spot_check_fraction=fraction) as lm:
                lm.generate("warm", gen_length=16, steps=4, block_length=16)
                return statistics.median(lm.generate("audit", **SETTINGS).elapsed_s for _ in range(3))

        base = timed(0.0)
        print(f"overhead on honest servers ({SETTINGS['steps']} steps, median of 3):")
        for fraction in (0.0, 0.25, 1.0):
            seconds = base if fraction == 0 else timed(fraction)
            print(f"  fraction {fraction:<5} {seconds:6.2f} s  ({seconds / base:.2f}x)")

        faulty = swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--throughput", "1e9",
                                    entry=FAULTY, name="faulty")
        print(f"faulty server among 2 honest replicas, {args.runs} runs per fraction:")
        for fraction in (0.1, 0.25, 1.0):
            caught_at, honest_tokens = [], 0
            for run in range(args.runs):
                with DistributedDiffusionLM.from_pretrained(path, initial_peers=swarm.initial_peers,
                                                            spot_check_fraction=fraction, spot_check_seed=run) as lm:
                    result = lm.generate("audit", **SETTINGS)
                    verdicts = [(o.step, o.verdict) for o in lm.sequence.spot_checker.outcomes]
                    steps = [step for step, verdict in verdicts if verdict == "primary_faulty"]
                    caught_at.append(steps[0] if steps else None)
                    honest_tokens += result.token_ids == expected
            caught = [s for s in caught_at if s is not None]
            print(f"  fraction {fraction:<5} caught in {len(caught)}/{args.runs} runs, at steps {caught_at}; "
                  f"tokens equal the honest run in {honest_tokens}/{args.runs}")
        swarm.terminate(faulty)


if __name__ == "__main__":
    main()
