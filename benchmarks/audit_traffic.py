"""How soon audit generations catch a server lying on any kind of call at a 5% rate (issue 48), and what a client's
default spot checks cost.

    python benchmarks/audit_traffic.py [--trials 100] [--sample 0.5] [--cost-runs 5]

Starts on 127.0.0.1 a bootstrap peer and, for a small model of its own (4 blocks), a ``--head`` server that lies on a
random one in 20 of its answers whatever they carry (``tests/faulty_server.py``'s ``faulty-1in20``: later calls,
cache fills and reuses, head queries, adapter calls alike). The arithmetic: an audit generation sends 32 calls through
the server and recomputes a share ``sample`` of them, so a lie is found with probability ``sample`` and a generation
misses the liar with probability ``(1 - sample x 0.05) ** 32``; N is the least number of generations whose miss
probability is at most 1%. Then ``--trials`` times a fresh audit client (the auditor's, as each round makes one)
runs generations through the liar until it is caught, and the script prints the share of trials caught within N
beside the 0.99 promised, and the mean generations beside the expected ``1 / (1 - miss)``.

With ``--cost-runs`` it also times a default client (``spot_check_fraction`` 0.05, the default) against one with
checks off, over two honest replicas of the same model, side by side (median seconds per generation of 32 steps).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, when run as a script

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from swarm.audit.auditor import Auditor  # noqa: E402
from swarm.audit.config import AuditorConfig  # noqa: E402
from swarm.audit.traffic import GEN_LENGTH, generations_to_catch  # noqa: E402
from swarm.client.config import DEFAULT_SPOT_CHECK_FRACTION  # noqa: E402
from swarm.client.model import DistributedDiffusionLM  # noqa: E402
from swarm.dht.config import NetworkConfig  # noqa: E402
from swarm.dht.schema import read_servers  # noqa: E402
from swarm.models.loading import ModelFiles  # noqa: E402
from swarm.reports.records import FAIL  # noqa: E402
from swarm.testing.checkpoints import make_checkpoint, tiny_config  # noqa: E402
from swarm.utils.local_swarm import LocalSwarm  # noqa: E402
from swarm.utils.threads import use_threads  # noqa: E402

FAULTY = str(ROOT / "tests" / "faulty_server.py")
LIE_RATE = 0.05


def catch_trials(swarm: LocalSwarm, path: Path, trials: int, sample: float, cap: int) -> list[int]:
    """Generations until the liar was caught, per trial (cap + 1 when it was not within ``cap``)."""
    network = NetworkConfig(initial_peers=swarm.initial_peers, client_mode=True)
    config = AuditorConfig(network=network, fresh_identity=False, once=True, sample=sample)
    found = []
    with Auditor(config, Ed25519PrivateKey.generate(), ModelFiles(path)) as auditor:
        servers = list(read_servers(auditor.dht, auditor.prefix, auditor.model.num_layers).values())
        liar = servers[0]
        for trial in range(trials):
            with auditor.round_client() as lm:
                started = time.perf_counter()
                check = auditor.traffic.check(lm, liar, servers, cap)
            caught = check.generations if check.verdict == FAIL else cap + 1
            found.append(caught)
            print(f"trial {trial + 1}: {check.verdict} after {check.generations} generations ({check.calls_checked} "
                  f"calls recomputed: {', '.join(check.kinds)}) in {time.perf_counter() - started:.1f} s; "
                  f"{check.reason}", flush=True)
    return found


def cost(swarm: LocalSwarm, path: Path, runs: int) -> dict[float, float]:
    """Median seconds per generation of 32 steps at fraction 0 and at the default, over two honest replicas."""
    seconds: dict[float, list[float]] = {0.0: [], DEFAULT_SPOT_CHECK_FRACTION: []}
    for _ in range(runs):
        for fraction in seconds:
            with DistributedDiffusionLM.from_pretrained(path, initial_peers=swarm.initial_peers,
                                                        spot_check_fraction=fraction) as lm:
                lm.generate("1+2=", gen_length=GEN_LENGTH, steps=GEN_LENGTH, block_length=16)  # warm: route, pings
                started = time.perf_counter()
                lm.generate("3+4=", gen_length=GEN_LENGTH, steps=GEN_LENGTH, block_length=16)
                seconds[fraction].append(time.perf_counter() - started)
    return {fraction: statistics.median(values) for fraction, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100, help="fresh audit clients, each until it catches the liar")
    parser.add_argument("--sample", type=float, default=0.5, help="share of calls the auditor recomputes")
    parser.add_argument("--cost-runs", type=int, default=0, help="paired generations timing a default client's checks")
    args = parser.parse_args()
    use_threads(1)
    miss = (1 - args.sample * LIE_RATE) ** GEN_LENGTH
    needed = generations_to_catch(args.sample, LIE_RATE, GEN_LENGTH)
    print(f"arithmetic: sample {args.sample}, lie rate {LIE_RATE}, {GEN_LENGTH} calls per generation: a generation "
          f"misses the liar with probability {miss:.4f}; caught with probability >= 0.99 within N = {needed} "
          f"generations ({1 - miss ** needed:.4f}); expected {1 / (1 - miss):.2f} generations", flush=True)
    with tempfile.TemporaryDirectory() as directory, LocalSwarm() as swarm:
        path = make_checkpoint(Path(directory) / "audit-traffic", tiny_config(), seed=21)
        swarm.start_bootstrap()
        liar = swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--head", "--public-name",
                                  "faulty-1in20", entry=(FAULTY,), name="faulty-1in20")
        found = catch_trials(swarm, path, args.trials, args.sample, 3 * needed)
        within = sum(1 for generations in found if generations <= needed) / len(found)
        print(f"\nmeasured over {len(found)} trials: caught within N = {needed} generations in {within:.1%} "
              f"(promised >= 99%); mean {statistics.mean(found):.2f} generations (expected {1 / (1 - miss):.2f}); "
              f"most {max(found)}")
        if args.cost_runs:
            swarm.terminate(liar)
            for _ in range(2):
                swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--head")
            medians = cost(swarm, path, args.cost_runs)
            base = medians[0.0]
            print(f"cost of default spot checks ({DEFAULT_SPOT_CHECK_FRACTION}) over two honest replicas, median of "
                  f"{args.cost_runs}: {medians[DEFAULT_SPOT_CHECK_FRACTION]:.3f} s vs {base:.3f} s per generation of "
                  f"{GEN_LENGTH} steps without checks: {medians[DEFAULT_SPOT_CHECK_FRACTION] / base:.2f}x")


if __name__ == "__main__":
    main()
