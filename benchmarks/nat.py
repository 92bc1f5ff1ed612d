"""Behind NAT, side by side: servers on public machines, servers behind NAT reached directly after hole punching,
and servers behind NAT reached only through relays (their routers pick a random port per connection).

Builds the network lab of ``swarm/testing/netlab.py`` (root, ``ip netns``, iptables): four public peers
(bootstrap and relays), a client behind its own NAT, and for each setting two servers (blocks 0:8 and 8:16)
started with default flags, one setting after the other so that they do not share the CPU. For each it prints how
long the servers took to join (start to serving, relay reservation included), how long the client took to join
and to finish its first generation (route challenge and hole punching included), the per-step latency once
connected (median over the later runs), which path each connection took, and the bytes sent by the public
machines hosting no server (relays, DHT) during the client's runs, next to the hidden-state bytes the client sent
and received. The lab adds no delay (netem is used only where the kernel has it), so latencies show the cost of
the relay's extra hop and processing on one machine, not of a longer internet path.

    sudo python -m benchmarks.nat                # from the repository root
    sudo python -m benchmarks.nat --runs 8 --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, when run as a script

from swarm.testing.netlab import LabConfig, NetLab, path_kind, relay_wait_seconds, unavailable_reason  # noqa: E402

SETTINGS = [  # (name, server homes or public machines, what the setting shows)
    ("no NAT", ("pub3", "pub4"), "servers on public machines"),
    ("NAT, direct", ("home1", "home2"), "ports kept by the routers: hole punching"),
    ("NAT, relayed", ("home3", "home4"), "random ports (symmetric NAT): relays only"),
]


@dataclass
class Outcome:
    setting: str
    servers_join_s: list[float]
    relay_wait_s: list[float]  # of the servers' join time, waiting for a relay reservation (0: none needed)
    client_join_s: float = 0.0
    first_step_s: float = 0.0  # route challenge, connections (and hole punching) included
    first_generation_s: float = 0.0
    step_ms: float = 0.0
    paths: list[str] = field(default_factory=list)
    relay_bytes: int = 0  # sent by the public machines that host no server (relays, DHT) while the client ran
    payload_bytes: int = 0  # hidden states the client sent and received


def measure(lab: NetLab, name: str, roles: tuple[str, str], args: argparse.Namespace) -> Outcome:
    prefix = "bench-" + name.replace(" ", "").replace(",", "-").lower()
    began = time.monotonic()
    servers = [lab.start_server(role, blocks, "--dht-prefix", prefix, wait=False)
               for role, blocks in zip(roles, ("0:8", "8:16"))]
    joined = []
    for server in servers:
        lab.wait_ready(server)
        joined.append(time.monotonic() - began)
    try:
        relays = [role for role in lab.public_roles if role not in roles]
        before = sum(lab.wan_bytes(role)[1] for role in relays)
        settings = dict(gen_length=args.tokens, steps=args.tokens, block_length=args.tokens, seed=0)
        client = lab.start_client("client1", "--dht-prefix", prefix, "--settings", json.dumps(settings),
                                  "--runs", str(args.runs))
        waits = [relay_wait_seconds(server) or 0.0 for server in servers]
        outcome = Outcome(name, joined, waits, client_join_s=client.wait_for("JOINED", 120)["seconds"])
        result = client.wait_for("RESULT", 600)
        runs = result["runs"]
        outcome.first_step_s = runs[0]["step_seconds"][0]
        outcome.first_generation_s = runs[0]["elapsed_s"]
        outcome.step_ms = 1000 * statistics.median(r["elapsed_s"] / len(r["step_seconds"]) for r in runs[1:])
        outcome.paths = [path_kind(result["paths"].get(s.peer_id, [])) for s in servers]
        outcome.relay_bytes = sum(lab.wan_bytes(role)[1] for role in relays) - before
        outcome.payload_bytes = result["bytes_sent"] + result["bytes_received"]
        return outcome
    finally:
        for server in servers:
            lab.terminate(server)


def table(outcomes: list[Outcome]) -> str:
    rows = [("", *(o.setting for o in outcomes)),
            ("servers joined (s)", *(" / ".join(f"{s:.1f}" for s in o.servers_join_s) for o in outcomes)),
            ("of which relay wait (s)", *(" / ".join(f"{s:.1f}" for s in o.relay_wait_s) for o in outcomes)),
            ("client joined (s)", *(f"{o.client_join_s:.1f}" for o in outcomes)),
            ("first step (s)", *(f"{o.first_step_s:.2f}" for o in outcomes)),
            ("first generation (s)", *(f"{o.first_generation_s:.2f}" for o in outcomes)),
            ("per step, connected (ms)", *(f"{o.step_ms:.1f}" for o in outcomes)),
            ("paths to 0:8 / 8:16", *(" / ".join(o.paths) for o in outcomes)),
            ("bytes sent by relays", *(f"{o.relay_bytes:,}" for o in outcomes)),
            ("hidden-state bytes", *(f"{o.payload_bytes:,}" for o in outcomes))]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=6, help="generations per setting (the first one connects)")
    parser.add_argument("--tokens", type=int, default=32, help="generated tokens = steps per generation")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    if args.runs < 2:
        parser.error("--runs must be at least 2: the first generation also connects")
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"cannot build the NAT lab: {reason}")
    with NetLab(LabConfig(homes=4, client_homes=1, symmetric_nat=("home3", "home4"))) as lab:
        lab.start_public_peers()
        outcomes = [measure(lab, name, roles, args) for name, roles, _ in SETTINGS]
    print(f"{args.runs} generations of {args.tokens} tokens ({args.tokens} steps) per setting, no added delay")
    for name, _, meaning in SETTINGS:
        print(f"  {name}: {meaning}")
    print(table(outcomes))
    if args.json:
        print(json.dumps([asdict(o) for o in outcomes], indent=2))


if __name__ == "__main__":
    main()
