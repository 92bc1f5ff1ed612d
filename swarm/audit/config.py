"""The auditor's settings (``python -m swarm.audit``), each declared once with its help text and bounds.

Plain data: importing this module loads neither torch nor hivemind, so the command's ``--help`` answers at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from swarm.client.config import ClientConfig
from swarm.dht.config import MAX_AUDIT_LIFETIME, NetworkConfig
from swarm.dht.peers import peer_id_problem
from swarm.train.config import TASK_NAMES
from swarm.utils.settings import check_settings, declared, need, setting

WEEK = 7 * 24 * 3600.0
SPOT_CHECK_RTOL = declared(ClientConfig, "spot_check_rtol").default  # the client's tolerance, declared once there


@dataclass
class AuditorConfig:
    """An auditor's settings; checked on creation, a ``SettingError`` (a ``ValueError``) naming the field."""

    network: NetworkConfig = field(default_factory=lambda: NetworkConfig(client_mode=True))
    dht_prefix: Optional[str] = setting(None, "DHT namespace of the model (default: the model directory's name, as "
                                              "servers use).")
    every: float = setting(300.0, "Seconds between audit rounds (each round checks every online server once).",
                           low=0.0, high=WEEK, low_open=True)
    jitter: float = setting(0.5, "Each pause between rounds is drawn uniformly within every x (1 +- jitter), so "
                                 "servers cannot tell when the next check comes.", low=0.0, high=0.9)
    once: bool = setting(False, "Run one round, publish its report and exit (exit 3 when the report is not read "
                                "back from the swarm).", flags=("--once",))
    fresh_identity: bool = setting(
        True, "Send each round's challenges from a new libp2p identity (a throwaway DHT peer, about a second to "
              "start), so a server cannot answer one known auditor id honestly and lie to everyone else; reports are "
              "still signed by --key.", flags=("--fresh-identity",))
    identity_lifetime: float = setting(
        3600.0, "Seconds the traffic identity of --fresh-identity is kept across rounds (drawn within x (1 +- "
                "jitter) each time a new one is made): a long-lived client's calls are the ones a server that lies "
                "only to long-seen peer ids lies on, so the auditor's must be one too; 0 makes a new one every round.",
        low=0.0, high=WEEK)
    evidence_dir: Optional[str] = setting(
        None, "A directory of clients' sampled calls (*.evidence files, DistributedDiffusionLM.save_audit_sample): "
              "each round recomputes up to 64 of them, fails a server proven to have signed a wrong answer, keeps "
              "the proofs in DIR/proofs and removes the rest (docs/AUDIT.md, \"Receipts and proofs\").", path=True)
    accept_evidence: bool = setting(
        True, "Take clients' evidence over libp2p on this auditor's own peer (a client's --evidence-to names its peer "
              "id, which the auditor logs at start): from any peer, each piece with a work stamp of 16 bits; each "
              "round recomputes up to 64 of them like --evidence-dir's files (docs/AUDIT.md, \"Receipts and "
              "proofs\").", flags=("--accept-evidence",))
    evidence_from: tuple[str, ...] = setting(
        (), "Peer id of a client whose evidence this auditor takes over libp2p without a work stamp and before "
            "strangers' (repeatable; also with --no-accept-evidence, which takes evidence only from these).",
        flags=("--evidence-from",))
    challenges: int = setting(1, "Challenges per server per round, one after another until one fails: a server "
                                 "lying on a share p of its answers is failed after about 1 / (p x challenges) "
                                 "rounds, at that many passes of its span per round.", low=1, high=64)
    generations: int = setting(
        1, "Whole generations per server per round, run as a client would (a random prompt and sampler settings, the "
           "activation cache, the server's head and a per-block adapter where it offers them; 32 calls each), so a "
           "server cannot answer audits honestly and lie on later calls, caches, head queries or adapters; 0 sends "
           "the single challenges only.", low=0, high=64)
    sample: float = setting(
        0.5, "Share of every generation's calls (each kind) recomputed on the auditor's own blocks and compared: a "
             "server lying on a share p of its calls is caught in one generation with probability "
             "1 - (1 - sample x p)^32.", low=0.0, high=1.0, low_open=True)
    request_timeout: float = setting(30.0, "Seconds a challenge may take through one server; longer is an error "
                                           "(no verdict on honesty).", low=0.0, high=3600.0, low_open=True)
    connect_timeout: float = setting(5.0, "Seconds for the ping that measures a server's round trip.", low=0.0,
                                     high=600.0, low_open=True)
    rtol: float = setting(SPOT_CHECK_RTOL, "Relative difference tolerated between a server's answer and the "
                                           "auditor's own computation (the client's spot-check tolerance).",
                          low=0.0, high=1.0, low_open=True)
    score_adapters: tuple[str, ...] = setting(
        (), "Also score every published adapter (at most 16) on this held-out task each round, through the swarm, and "
            f"publish the scores (repeatable; one of: {', '.join(TASK_NAMES)}). Clients' adapter='best:TASK' picks "
            "by them.", flags=("--score-adapters",))
    task_examples: int = setting(20, "Held-out problems per adapter and task each round (drawn anew every round).",
                                 low=1, high=10_000)
    lifetime: Optional[float] = setting(None, "Seconds each published report lives on the DHT (default: 3 x every, "
                                              "at least 10 minutes, at most a day).", low=60.0,
                                        high=MAX_AUDIT_LIFETIME - 60.0)

    def __post_init__(self) -> None:
        check_settings(self)
        unknown = [task for task in self.score_adapters if task not in TASK_NAMES]
        problem = peer_id_problem(self.evidence_from, "--evidence-from")
        need(problem is None, problem or "", "evidence_from")
        need(not unknown, f"--score-adapters: unknown task {', '.join(map(repr, unknown))} (one of: "
                          f"{', '.join(TASK_NAMES)})", "score_adapters")

    @property
    def report_lifetime(self) -> float:
        chosen = self.lifetime if self.lifetime is not None else max(3 * self.every, 600.0)
        return min(chosen, MAX_AUDIT_LIFETIME - 60.0)
