"""The auditor's demonstration (docs/AUDIT.md, issue 39): two liars found, published, and avoided by a fresh client;
two adapters' claims against their measured scores, and ``best:addition`` picking the truly better one.

    python benchmarks/audit_demo.py [--challenges 4] [--examples 30] [--max-rounds 200] [--no-fresh-identity]
                                    [--delivered 100] [--lies-one-in 20] [--json]

On 127.0.0.1: a bootstrap peer and four servers of the embedded addition model (4 blocks), all announcing 1000
tokens/s: two honest halves (A 0:2, which also serves two published soft-prompt adapters, and B 2:4), C (0:4) that
lies on a random one in 20 of its answers (``--lies-one-in``), and D (0:4) that answers honestly at 100 positions/s
at most (``--delivered``; its slow answers are most of a round): it announces 10x what it delivers (C and D are the
test-only tests/faulty_server.py). The adapters' authors claim 0.99 for a random soft prompt and 0.1 for a
better one.

1. Before any audit, a fresh client that trusts no auditor generates: its route goes through C or D (one hop is
   cheaper than two, at the speeds they announce).
2. One auditor (in this process) runs rounds back to back, ``--challenges`` challenges per server each (4: the
   1-in-20 liar is expected to fail in 5 rounds); the first round also scores both adapters on held-out sums; rounds go
   on until C is failed and D is flagged (its announced throughput over the client's ``overclaim_factor``
   times what its delivery calibrates to), or ``--max-rounds``.
3. A fresh client that trusts the auditor generates: it routes A -> B (C avoided, D routed by its calibrated
   throughput), gives the local model's tokens, and ``adapter="best:addition"`` picks the better adapter.

Prints what happened, with the figures docs/AUDIT.md quotes (rounds and seconds until each liar was found, seconds per
round, report size); ``--json`` prints one JSON object instead (tests/test_audit_swarm.py runs it so).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, when run as a script

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402
from hivemind import DHT  # noqa: E402

from swarm.adapters.sharing import ENV_CACHE, make_record, publish  # noqa: E402
from swarm.audit.auditor import Auditor  # noqa: E402
from swarm.audit.config import AuditorConfig  # noqa: E402
from swarm.client.config import ClientConfig  # noqa: E402
from swarm.client.model import DistributedDiffusionLM  # noqa: E402
from swarm.dht.config import NetworkConfig  # noqa: E402
from swarm.frontend.local import DiffusionLM  # noqa: E402
from swarm.governance.keys import public_key_text  # noqa: E402
from swarm.models.loading import ModelFiles  # noqa: E402
from swarm.reports.records import FAIL  # noqa: E402
from swarm.testing.adapters import random_soft_prompt  # noqa: E402
from swarm.utils.local_swarm import LocalSwarm  # noqa: E402
from swarm.utils.threads import use_threads  # noqa: E402

FAULTY = (str(ROOT / "tests" / "faulty_server.py"),)
MODEL = "addition"
PROMPT = "12+5="
GREEDY = dict(gen_length=8, steps=8, block_length=8, temperature=0.0)
ANNOUNCED = 1000  # tokens/s every server announces (LocalSwarm's default)
DELIVERED = 100  # positions/s server D delivers at most by default: a tenth of what it announces
LIES_ONE_IN = 20  # server C lies on a random one in this many of its answers by default
ADAPTERS = (("boaster", 1.0, 4, 0.99), ("modest", 5.0, 2, 0.1))  # name, scale, length, the author's claimed score


def names_of(route: list[str], servers: dict[str, str]) -> list[str]:
    """A result's route (hops as ``RouteHop`` prints them: the peer id's last 8 characters, then the span) with the
    demo's name of each server."""
    short = {peer[-8:]: name for peer, name in servers.items()}
    return [short.get(hop.split("[")[0], hop) for hop in route]


def client_run(swarm: LocalSwarm, servers: dict[str, str], cache: Path, trusted: tuple[str, ...],
               adapter: bool, prefix: Optional[str], dht: Optional[DHT] = None,
               spot_checks: bool = True) -> dict[str, Any]:
    """A fresh client (trusting ``trusted``) generates the prompt; with ``adapter`` also with ``best:addition``. On
    ``dht`` (a running peer, not the auditor's: what it reads of audits comes over the swarm) instead of its own.
    Without ``spot_checks`` it checks no server itself, so that its route is where announcements alone send it: with
    them, its own check may catch a liar that lies often (1 answer in 4 in the test) and reroute, by chance."""
    config = ClientConfig(network=NetworkConfig(initial_peers=swarm.initial_peers, client_mode=True),
                          trusted_auditors=trusted, dht_prefix=prefix,
                          **({} if spot_checks else {"spot_check_fraction": 0.0}))
    with DistributedDiffusionLM(ModelFiles(MODEL), config, dht=dht) as lm:
        lm.adapter_cache = cache
        result = lm.generate(PROMPT, seed=0, **GREEDY)
        out = {"route": names_of(result.info["route"], servers), "tokens": result.token_ids,
               "audit_failed": [servers.get(p, p) for p in result.info["audit_failed"]],
               "audit_overclaimed": {servers.get(p, p): r for p, r in result.info["audit_overclaimed"].items()}}
        if adapter:
            best = lm.generate(PROMPT, adapter="best:addition", seed=0, **GREEDY)
            out["best_adapter"] = lm.best_adapters["addition"][1]
            out["best_adapter_tokens"] = best.token_ids
    return out


def audit_until_found(auditor: Auditor, liar: str, slow: str, max_rounds: int, factor: float) -> dict[str, Any]:
    """Rounds back to back (the first scores the adapters) until the liar is failed and the slow server's overclaim
    is over ``factor``; when each was first found (round, seconds since the first round began) and each round's cost."""
    found: dict[str, tuple[int, float]] = {}
    times, sizes = [], []
    started = time.perf_counter()
    result = None
    for number in range(1, max_rounds + 1):
        result = auditor.run_round(score=number == 1)
        times.append(result.seconds)
        sizes.append(len(result.report.payload()))
        if result.checked.get(liar) is not None and result.checked[liar].verdict == FAIL:
            found.setdefault("liar", (number, time.perf_counter() - started))
        entry = result.report.server(slow)
        if entry is not None and entry.overclaim is not None and entry.overclaim > factor:
            found.setdefault("overclaimer", (number, time.perf_counter() - started))
        if len(found) == 2:
            break
    return {"found": found, "rounds": len(times), "round_seconds": times, "report_bytes": max(sizes),
            "report": result.report if result else None}


@contextlib.contextmanager
def shared_or_own(shared: Optional[LocalSwarm]) -> Iterator[LocalSwarm]:
    """``shared``, a running swarm with a bootstrap peer (a test's: a second fork server and bootstrap peer would
    cost about 4 CPU s and show nothing more), or else a swarm of its own with a bootstrap peer, every process forked
    from one that imported torch and hivemind (one import for the five processes instead of five)."""
    if shared is not None:
        yield shared
        return
    with LocalSwarm(fork_server=True) as swarm:
        swarm.start_bootstrap()
        yield swarm


def run(examples: int, max_rounds: int, fresh_identity: bool, challenges: int,
        delivered: int = DELIVERED, swarm: Optional[LocalSwarm] = None, prefix: Optional[str] = None,
        lies_one_in: int = LIES_ONE_IN, client_dht: Optional[DHT] = None) -> dict[str, Any]:
    """The whole demonstration; what it found, as plain data. On ``swarm``, a running one (its servers are SIGKILLed
    at the end), instead of a swarm of its own; under the DHT namespace ``prefix`` instead of the model's (on a shared
    swarm: no other server of the model joins the routes it shows). ``client_dht``: a running DHT peer on that swarm
    for the two fresh clients (a test's shared one: two DHT peers and libp2p daemons fewer, 2-3 CPU s), instead of
    one each; a client's state is its own either way, and the auditor keeps its own peer, so the clients read its
    report over the swarm."""
    use_threads(1)
    work = Path(tempfile.mkdtemp(prefix="audit-demo-"))
    os.environ[ENV_CACHE] = str(work / "auditor-cache")  # the auditor's client fetches the adapters here
    os.environ.setdefault("SWARM_STAMP_BITS", "16")  # a private local swarm: see swarm/improve/demo.py
    shared, started = swarm, []
    with shared_or_own(shared) as swarm, contextlib.ExitStack() as leaving:
        local = DiffusionLM.from_pretrained(MODEL)
        adapters = {name: random_soft_prompt(local, work / name, scale, length)
                    for name, scale, length, _ in ADAPTERS}
        common = ("--compute-threads", "1", *(("--dht-prefix", prefix) if prefix else ()))
        serve = [arg for path in adapters.values() for arg in ("--serve-adapter", str(path))]
        for name, blocks, extra in (("A", "0:2", serve), ("B", "2:4", ()),
                                    ("C", "0:4", ("--public-name", f"faulty-1in{lies_one_in}")),
                                    ("D", "0:4", ("--public-name", f"faulty-rate{delivered}"))):
            entry = {"entry": FAULTY} if name in "CD" else {}
            started.append(swarm.start_server(MODEL, blocks, *common, *extra, name=name, wait=False, **entry))
            if shared is not None:  # a swarm of its own stops them all as it closes
                leaving.callback(swarm.terminate, started[-1], signal.SIGKILL)
        for server in started:
            swarm.wait_ready(server)
        servers = {server.peer_id: server.name for server in started}
        by_name = {server.name: server.peer_id for server in started}
        network = NetworkConfig(initial_peers=swarm.initial_peers, client_mode=True)
        config = AuditorConfig(network=network, dht_prefix=prefix, score_adapters=("addition",),
                               task_examples=examples, fresh_identity=fresh_identity, challenges=challenges)
        with Auditor(config, Ed25519PrivateKey.generate(), ModelFiles(MODEL)) as auditor:
            for (name, _, _, claim), path in zip(ADAPTERS, adapters.values()):
                publish(auditor.dht, Ed25519PrivateKey.generate(), auditor.prefix,
                        make_record(path, name, claim, [by_name["A"]]))
            before = client_run(swarm, servers, work / "client-cache", ("none",), False, prefix, client_dht,
                                spot_checks=False)
            factor = ClientConfig().overclaim_factor
            audit = audit_until_found(auditor, by_name["C"], by_name["D"], max_rounds, factor)
            key = public_key_text(auditor.key)
            after = client_run(swarm, servers, work / "client-cache", (key,), True, prefix, client_dht)
        report = audit.pop("report")
        entries = {servers[e.peer_id]: e for e in report.servers}
        scores = {a.name: {"claimed": a.claimed, "correct": a.correct, "examples": a.examples,
                           "reference": a.reference} for a in report.adapters}
        return {
            "servers": {name: {"blocks": f"{e.start}:{e.end}", "verdict": e.verdict, "passed": e.passed,
                               "failed": e.failed, "announced": e.announced, "measured": e.measured,
                               "calibrated": e.calibrated, "overclaim": e.overclaim} for name, e in entries.items()},
            "found": {what: {"round": number, "seconds": seconds}
                      for what, (number, seconds) in audit["found"].items()},
            "rounds": audit["rounds"], "round_seconds_median": statistics.median(audit["round_seconds"]),
            "first_round_seconds": audit["round_seconds"][0], "report_bytes": audit["report_bytes"],
            "fresh_identity": fresh_identity, "overclaim_factor": factor, "every_default": AuditorConfig().every,
            "challenges": challenges,
            "before": before, "after": after, "local_tokens": local.generate(PROMPT, seed=0, **GREEDY).token_ids,
            "adapters": scores,
            "local_best_tokens": local.generate(PROMPT, adapter=str(adapters["modest"]), seed=0, **GREEDY).token_ids,
        }


def summary(found: dict[str, Any]) -> str:
    """What a reader of docs/AUDIT.md wants to see, as text."""
    lines = ["servers (all announce 1000 tok/s):"]
    for name, s in sorted(found["servers"].items()):
        lines.append(f"  {name} {s['blocks']}: {s['verdict']} (passed {s['passed']}, failed {s['failed']}), measured "
                     f"{s['measured'] or 0:.0f} tok/s, calibrated {s['calibrated'] or 0:.0f}, overclaim "
                     f"{s['overclaim'] or 0:.1f}x")
    every = found["every_default"]
    for what, at in found["found"].items():
        lines.append(f"{what} found in round {at['round']} after {at['seconds']:.1f} s of back-to-back rounds "
                     f"(at the default --every {every:.0f} s: about {at['round'] * every / 60:.0f} min)")
    missing = {"liar", "overclaimer"} - set(found["found"])
    if missing:
        lines.append(f"NOT found within {found['rounds']} rounds: {', '.join(sorted(missing))}")
    lines.append(f"{found['rounds']} rounds of {found['challenges']} challenges per server, median "
                 f"{found['round_seconds_median']:.2f} s (the first, scoring the adapters: "
                 f"{found['first_round_seconds']:.1f} s); report {found['report_bytes']} bytes; fresh identity per "
                 f"round: {found['fresh_identity']}; at the default --every: "
                 f"{found['challenges'] * 3600 / every:.0f} passes per server per hour")
    lines.append(f"client trusting no auditor (and spot-checking nothing): route "
                 f"{' -> '.join(found['before']['route'])}")
    after = found["after"]
    lines.append(f"fresh client trusting the auditor: route {' -> '.join(after['route'])}, avoiding "
                 f"{after['audit_failed']}, overclaimed {after['audit_overclaimed']}; local tokens: "
                 f"{after['tokens'] == found['local_tokens']}")
    for name, score in sorted(found["adapters"].items()):
        lines.append(f"adapter {name}: claimed {score['claimed']}, measured {score['correct']}/{score['examples']}")
    lines.append(f"best:addition picks {after['best_adapter']}; its tokens equal the local adapter's: "
                 f"{after['best_adapter_tokens'] == found['local_best_tokens']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--challenges", type=int, default=4, help="challenges per server per round (--challenges)")
    parser.add_argument("--examples", type=int, default=30, help="held-out sums per adapter in the scoring round")
    parser.add_argument("--max-rounds", type=int, default=200, help="give up after this many audit rounds")
    parser.add_argument("--no-fresh-identity", action="store_true",
                        help="challenge from the auditor's own peer instead of a fresh one per round (faster rounds)")
    parser.add_argument("--delivered", type=int, default=DELIVERED,
                        help="positions/s D delivers at most (it announces 1000 tokens/s): higher, shorter rounds")
    parser.add_argument("--lies-one-in", type=int, default=LIES_ONE_IN,
                        help="C lies on a random one in this many of its answers: lower, found in fewer rounds")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    args = parser.parse_args()
    for name in ("challenges", "examples", "max_rounds", "delivered", "lies_one_in"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    found = run(args.examples, args.max_rounds, not args.no_fresh_identity, args.challenges, args.delivered,
                lies_one_in=args.lies_one_in)
    print(json.dumps(found) if args.json else summary(found))


if __name__ == "__main__":
    main()
