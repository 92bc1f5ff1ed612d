"""Measure the auditor (issue 39): seconds per audit round, report size, and rounds until each liar is failed.

    python benchmarks/audit_round.py [--rounds 40] [--model default] [--no-fresh-identity]

Starts on 127.0.0.1 a bootstrap peer and, for the model (default: the embedded one, 16 blocks), two honest servers
(0:8, 8:16), a server that lies on every answer (0:16) and one that lies on a random one in 20 of its answers (0:16;
both are the test-only tests/faulty_server.py). Then one auditor, in this process, runs ``--rounds`` rounds back to
back (``--every`` does not matter here: the pause between rounds is not measured; each round's challenges come from
a fresh identity unless ``--no-fresh-identity``) and prints each round's wall time (checks of every server and the
publication of the signed report, read back from the swarm), the report's size, and the round at which each liar was
first failed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, when run as a script

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from swarm.audit.auditor import Auditor  # noqa: E402
from swarm.audit.config import AuditorConfig  # noqa: E402
from swarm.dht.config import NetworkConfig  # noqa: E402
from swarm.models.loading import ModelFiles  # noqa: E402
from swarm.reports.records import FAIL  # noqa: E402
from swarm.utils.local_swarm import LocalSwarm  # noqa: E402
from swarm.utils.threads import use_threads  # noqa: E402

FAULTY = str(ROOT / "tests" / "faulty_server.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="audit rounds to run back to back")
    parser.add_argument("--model", default="default", help="embedded model name or checkpoint directory")
    parser.add_argument("--no-fresh-identity", action="store_true",
                        help="challenge from the auditor's own peer instead of a fresh one per round")
    args = parser.parse_args()
    use_threads(1)
    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        common = ("--compute-threads", "1")
        honest = [swarm.start_server(args.model, span, *common, wait=False) for span in ("0:8", "8:16")]
        liar = swarm.start_server(args.model, "0:16", *common, entry=(FAULTY,), name="faulty", wait=False)
        rare = swarm.start_server(args.model, "0:16", *common, "--public-name", "faulty-1in20", entry=(FAULTY,),
                                  name="faulty-1in20", wait=False)
        for server in (*honest, liar, rare):
            swarm.wait_ready(server)
        config = AuditorConfig(network=NetworkConfig(initial_peers=swarm.initial_peers, client_mode=True), once=True,
                               fresh_identity=not args.no_fresh_identity)
        caught: dict[str, int] = {}
        times, sizes = [], []
        with Auditor(config, Ed25519PrivateKey.generate(), ModelFiles(args.model)) as auditor:
            for round_number in range(1, args.rounds + 1):
                result = auditor.run_round()
                times.append(result.seconds)
                sizes.append(len(result.report.payload()))
                for peer, check in result.checked.items():
                    if check.verdict == FAIL:
                        caught.setdefault(peer, round_number)
                honest_fails = [p for p in caught if p in {s.peer_id for s in honest}]
                print(f"round {round_number}: {len(result.checked)} servers in {result.seconds:.2f} s, report "
                      f"{sizes[-1]} bytes, published {result.published}"
                      + (f"; HONEST SERVER FAILED: {honest_fails}" if honest_fails else ""), flush=True)
            measured = {peer: audit.measured for peer, audit in auditor.audits.items()}
        print(f"\nmodel {args.model}, 4 servers, {args.rounds} rounds, fresh identity {config.fresh_identity}: median "
              f"{statistics.median(times):.2f} s per round (min {min(times):.2f}, max {max(times):.2f}); report "
              f"{max(sizes)} bytes")
        print(f"always-lying server failed at round {caught.get(liar.peer_id)}; 1-in-20 liar failed at round "
              f"{caught.get(rare.peer_id)}; honest servers failed: "
              f"{sum(1 for s in honest if s.peer_id in caught)}")
        for server in (*honest, liar, rare):
            print(f"  {server.name}: measured {measured.get(server.peer_id) or 0:.0f} tok/s at the last check")


if __name__ == "__main__":
    main()
