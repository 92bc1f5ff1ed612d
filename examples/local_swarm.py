"""Start a bootstrap peer and two servers on 127.0.0.1, generate through them, and stop everything.

    python examples/local_swarm.py "The government said"
    python examples/local_swarm.py --failover "The government said"

The two servers host blocks 0:8 and 8:16 of the embedded default model; the script checks that the swarm
gives exactly the tokens of the same model run in one process. With ``--failover`` a third server holds a
replica of 8:16, and the server the route uses for those blocks is killed (SIGKILL) mid-generation: the
script prints how long the generation stalled, from the kill to the next completed step, and fails when
that exceeds ``--max-failover-s``. The exit status is 0 only when every check holds.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from dataclasses import dataclass
from typing import Optional

from swarm import DiffusionLM
from swarm.client import DistributedDiffusionLM
from swarm.models.loading import ModelFiles
from swarm.utils.local_swarm import LocalSwarm, ManagedProcess
from swarm.utils.progress import StepLine

SETTINGS = dict(gen_length=32, steps=32, block_length=32, seed=0)  # 64 tokens cost ~2.7x the CPU (longer steps)
KILL_AT_STEP = 8
PROGRESS_EVERY = 16  # off a terminal (a log, CI), one progress line per this many steps


@dataclass
class Failover:
    """SIGKILLs ``victim`` once the generation has completed ``at_step``; measures the stall it causes."""

    swarm: LocalSwarm
    victim: ManagedProcess
    at_step: int = KILL_AT_STEP
    killed_at: Optional[float] = None
    seconds: Optional[float] = None  # from the kill to the next completed step

    def after_step(self, step: int) -> None:
        if self.killed_at is not None and self.seconds is None:
            self.seconds = time.monotonic() - self.killed_at
        if step == self.at_step:
            self.swarm.terminate(self.victim, signal.SIGKILL)
            self.killed_at = time.monotonic()


def start_servers(swarm: LocalSwarm, replica: bool) -> None:
    num_layers = ModelFiles("default").config.num_layers
    half = num_layers // 2
    spans = [(0, half), (half, num_layers)] + ([(half, num_layers)] if replica else [])
    servers = [swarm.start_server("default", f"{a}:{b}", wait=False) for a, b in spans]
    for server in servers:
        swarm.wait_ready(server)
        print(f"  server {server.peer_id[-8:]} hosts blocks {server.span[0]}:{server.span[1]}")


def generate(lm: DistributedDiffusionLM, prompt: str, failover: Optional[Failover]):
    """Stream the generation through the swarm, showing each step; returns the result."""
    result, line = None, StepLine(stream=sys.stdout, plain_every=PROGRESS_EVERY)  # redrawn only on a terminal
    for chunk in lm.generate_stream(prompt, **SETTINGS):
        if not chunk.done:
            line.show(f"[step {chunk.step + 1:3d}] {prompt}{chunk.text}")
            if failover is not None:
                failover.after_step(chunk.step)
        result = chunk.result
    line.close()
    return result


def main(prompt: str, failover: bool = False, max_failover_s: float = 2.0) -> int:
    logging.basicConfig(level=logging.ERROR)  # a killed server makes the client warn; the checks below say it
    with LocalSwarm(fork_server=True) as swarm:  # each process forked from one that imported torch: ~1 CPU s less each
        print(f"starting a bootstrap peer and {3 if failover else 2} servers on 127.0.0.1 ...", flush=True)
        swarm.start_bootstrap()
        start_servers(swarm, replica=failover)
        with DistributedDiffusionLM.from_pretrained("default", initial_peers=swarm.initial_peers) as lm:
            route = lm.show_route()
            print("route:", " -> ".join(map(str, route)))
            victim = next(p for p in swarm.processes if p.peer_id == route[-1].peer_id)
            killer = Failover(swarm, victim) if failover else None
            started = time.perf_counter()
            result = generate(lm, prompt, killer)
            print(f"\nswarm ({time.perf_counter() - started:.1f} s): {prompt}{result.text}")
    local = DiffusionLM.from_pretrained("default").generate(prompt, **SETTINGS)
    ok = local.token_ids == result.token_ids
    print(f"local result identical to the swarm's: {ok}")
    if killer is not None:
        fast = killer.seconds is not None and killer.seconds <= max_failover_s
        moved = victim.peer_id not in " ".join(result.info["route"]) and bool(result.info["failovers"])
        stall = f"{killer.seconds:.2f} s" if killer.seconds is not None else "never recovered"
        print(f"failover from SIGKILL at step {killer.at_step} to the next completed step: {stall} "
              f"(bound {max_failover_s:.1f} s); route now {' -> '.join(result.info['route'])}")
        ok = ok and fast and moved
    return 0 if ok else 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt", nargs="?", default="The government said", help="Text to continue.")
    parser.add_argument("--failover", action="store_true",
                        help=f"Add a replica of the last span and SIGKILL the route's server for it after step "
                             f"{KILL_AT_STEP}; check the tokens and the stall.")
    parser.add_argument("--max-failover-s", type=float, default=2.0,
                        help="With --failover: fail when the stall from the kill to the next step exceeds this.")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    sys.exit(main(args.prompt, args.failover, args.max_failover_s))
