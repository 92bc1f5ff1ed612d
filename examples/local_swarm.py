"""Start a bootstrap peer and two servers on 127.0.0.1, generate through them, and stop everything.

    python examples/local_swarm.py "The government said"

The two servers host blocks 0:8 and 8:16 of the embedded default model; the script checks that the swarm
gives exactly the tokens of the same model run in one process.
"""
from __future__ import annotations

import logging
import sys
import time

from swarm import DiffusionLM
from swarm.client import DistributedDiffusionLM
from swarm.models.loading import ModelFiles
from swarm.utils.local_swarm import LocalSwarm


def main(prompt: str = "The government said") -> int:
    logging.basicConfig(level=logging.WARNING)
    num_layers = ModelFiles("default").config.num_layers
    half = num_layers // 2
    settings = dict(gen_length=64, steps=64, block_length=32, seed=0)
    with LocalSwarm() as swarm:
        print("starting a bootstrap peer and two servers on 127.0.0.1 ...", flush=True)
        swarm.start_bootstrap()
        servers = [swarm.start_server("default", f"{a}:{b}", wait=False) for a, b in ((0, half), (half, num_layers))]
        for server in servers:
            swarm.wait_ready(server)
            print(f"  server {server.peer_id[-8:]} hosts blocks {server.span[0]}:{server.span[1]}")
        with DistributedDiffusionLM.from_pretrained("default", initial_peers=swarm.initial_peers) as lm:
            print("route:", " -> ".join(map(str, lm.show_route())))
            started = time.perf_counter()
            result = None
            for chunk in lm.generate_stream(prompt, **settings):
                if not chunk.done:
                    print(f"\r[step {chunk.step + 1:3d}] {prompt}{chunk.text}"[:120], end="", flush=True)
                result = chunk.result
            print(f"\n\nswarm ({time.perf_counter() - started:.1f} s): {prompt}{result.text}")
    local = DiffusionLM.from_pretrained("default").generate(prompt, **settings)
    same = local.token_ids == result.token_ids
    print(f"local result identical to the swarm's: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
