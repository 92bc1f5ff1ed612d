"""The auditor: each round, one challenge per online server, checked against the auditor's own copy of the blocks.

A challenge is a forward call a server cannot tell from a client's: a fresh session, a step drawn like a
generation's, and the hidden states of a *masked state of a prompt*, embedded by the auditor's copy of the embedding
exactly as a client embeds its tokens: a random prompt followed by a generated part in which each position is still
the mask token with a probability drawn per challenge (a generation somewhere between its first and last step), the
whole length drawn like real requests' (``swarm.client.planner.CHALLENGE_ROWS``). It goes through the span the
server announces, from a libp2p identity of a client's kind that is not the auditor's own (a DHT peer with a fresh
Ed25519 key, kept across rounds for ``--identity-lifetime`` seconds like a long-lived client's, then replaced;
``--no-fresh-identity`` uses the auditor's own peer, one key per run unless ``--identity-path`` is given), so a server
can neither single the auditor out by its peer id nor spare identities it has not seen for long. The answer is
compared with the auditor's own computation of those blocks with the client's spot-check comparison and tolerance
(``swarm.client.spot_check.answers_agree``, ``ClientConfig.spot_check_rtol``): a wrong answer *fails* the server, no
answer (unreachable, refused, timed out) is an *error* (no verdict on honesty), a right one *passes*. The same call
measures the server: its ping's round trip, the call's seconds and the throughput it delivered (rows / seconds, as
a client waits for them), beside what its record announces.

A single fresh first call is easy to single out, so each round also runs ``--generations`` whole generations through
every server as a client would (with caches, head queries and adapters where the server offers them) and recomputes a
random share ``--sample`` of every kind of call on the auditor's own blocks (:mod:`swarm.audit.traffic`).

With ``--score-adapters TASK`` it also scores every published adapter (the first :data:`MAX_ADAPTERS` the catalog
lists) on held-out problems of ``swarm.eval``'s task, drawn anew each round from ``os.urandom``, generating *through
the swarm* as a user would (``adapter="name@AUTHOR"``; a client of the auditor's own DHT peer that trusts the
auditor itself, so servers it failed are avoided), and publishes the exact-match score beside the author's claim.

After each round the auditor publishes one signed report (:mod:`swarm.reports.records`) with every server's counts
since the auditor started, and the latest score of each adapter content per task.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import random
import statistics
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht import DHT

from swarm.adapters.adapter import AdapterError
from swarm.adapters.sharing import MAX_CATALOG_NAMES
from swarm.adapters.versions import published_versions, reference_of
from swarm.audit import inbox
from swarm.audit.config import AuditorConfig
from swarm.audit.handoff import EvidenceInbox
from swarm.audit.traffic import TrafficAuditor, TrafficCheck, client_config
from swarm.client.config import DEFAULT_OVERCLAIM_FACTOR, ClientConfig
from swarm.client.model import DistributedDiffusionLM
from swarm.client.planner import CHALLENGE_ROWS, CHALLENGE_STEPS
from swarm.client.proofs import Finding, Verdict, verify_evidence
from swarm.client.receipts import save_sample
from swarm.client.reference import LocalReference
from swarm.client.spot_check import answers_agree, relative_difference
from swarm.dht.node import start_dht, stop_dht
from swarm.dht.schema import ServerRecord, ServerState, default_prefix, protected_keys, read_servers
from swarm.dht.validation import ed25519_text
from swarm.eval.tasks import evaluate_task
from swarm.models.loading import ModelFiles
from swarm.reports.adoption import to_score
from swarm.reports.records import (
    ERROR,
    FAIL,
    MAX_ADAPTERS,
    MAX_REASON_CHARS,
    MAX_SERVERS,
    PASS,
    AdapterAudit,
    AuditReport,
    ServerAudit,
    publish_report,
)
from swarm.server.usage import parse_usage
from swarm.train.data import TASKS
from swarm.utils.errors import SwarmError
from swarm.utils.event_loop import BackgroundLoop
from swarm.wire.evidence import CallEvidence
from swarm.wire.messages import ErrorCode, ForwardRequest, RemoteError
from swarm.wire.remote import RemoteCaller
from swarm.wire.work import stamper_for

logger = logging.getLogger(__name__)

SPEED_CHECKS = 8  # a server's speed is the best its last answered checks delivered (a slow moment is not a lie)
MAX_PROOFS = 64  # proofs among handed evidence kept in memory


async def _on_loop(fn: Callable[[], Any]) -> Any:
    """``fn()`` on the event loop (what the evidence handler mutates is touched only there)."""
    return fn()


def calibrate(delivered: Mapping[str, float], announced: Mapping[str, float]) -> dict[str, float]:
    """Per server of ``delivered`` (tokens/s its checks delivered, the best of recent ones), what it would announce if
    it claimed what its peers claim for the same delivery.

    A check's figure (rows over the call's time, as the caller waits for it) includes the wire and per-call costs, so
    it is below what a server measures of its own compute (``--throughput auto``) by a factor that depends on the
    model and the links, not on honesty. The median announced/delivered ratio of the servers stands for that factor;
    a server announcing far more than its delivery times that median claims more than its peers do for the same
    delivery (``ServerAudit.overclaim``). A lone server is its own median (never an overclaim); overclaimers that are a
    majority would move the median (docs/AUDIT.md)."""
    ratios = [announced[peer] / max(speed, 1e-6) for peer, speed in delivered.items() if peer in announced]
    if not ratios:
        return {}
    ratio = statistics.median(ratios)
    return {peer: speed * ratio for peer, speed in delivered.items() if peer in announced}


@dataclass
class Check:
    """One challenge of one server."""

    verdict: str
    reason: str = ""
    rows: int = 0
    rtt: Optional[float] = None
    seconds: Optional[float] = None
    usage: Optional[tuple[int, float, int]] = None  # the server's own totals at the ping (tokens, seconds, requests)

    @property
    def measured(self) -> Optional[float]:
        """Tokens per second the call delivered as the caller waits for it, round trip included (None without an
        answer). Subtracting the ping would blow a call about as short as the ping up to millions of tokens/s."""
        if self.verdict == ERROR or self.seconds is None:
            return None
        return self.rows / max(self.seconds, 1e-6)


@dataclass
class RoundResult:
    report: AuditReport
    checked: dict[str, Check]
    published: bool
    seconds: float  # the round's wall time, publication included


@dataclass
class TrafficIdentity:
    """The DHT peer (its own key) that rounds' challenges and generations come from, until ``renew_at``
    (``time.monotonic()``)."""

    dht: DHT
    caller: RemoteCaller
    renew_at: float


def reported_scores(scores: Iterable[AdapterAudit], limit: int) -> tuple[AdapterAudit, ...]:
    """The adapter scores a report lists (it holds ``limit``): those that found a version right on some problem first,
    then the latest. An auditor scoring several tasks scores every version on each, and most of those scores are 0
    (a version of one task's stream on another task), which no reader adopts (``swarm.reports.adoption``): listed by
    time alone, the 0s of the versions scored last in a round took the places of the scores of those scored first,
    the new versions (the streams demonstration with three tasks: its newest versions went unlisted)."""
    chosen = sorted(scores, key=lambda a: (a.correct > 0, a.checked), reverse=True)[:limit]
    return tuple(sorted(chosen, key=lambda a: (a.name, a.task, a.sha256)))


class Auditor:
    """Checks the servers of one model and publishes what it found (see the module doc)."""

    def __init__(self, config: AuditorConfig, key: Ed25519PrivateKey, files: ModelFiles, dht: Optional[DHT] = None):
        self.config, self.key, self.files = config, key, files
        self.model = files.config
        self.prefix = config.dht_prefix or default_prefix(files.path)
        self.public_key = ed25519_text(key)
        self._own_dht = dht is None
        self.dht = dht if dht is not None else start_dht(config.network, protect=protected_keys(
            self.prefix, self.model.num_layers, auditors=[self.public_key]))
        self.loop = BackgroundLoop.shared()
        self.p2p = self.loop.run(self.dht.replicate_p2p())
        self.caller = self._caller(self.p2p)
        self.handed = EvidenceInbox(config.evidence_from, config.accept_evidence)  # clients' evidence over libp2p
        self.proofs: deque[CallEvidence] = deque(maxlen=MAX_PROOFS)  # proven lies among what clients handed
        self._serving = bool(config.accept_evidence or config.evidence_from)
        if self._serving:
            try:
                self.loop.run(self.handed.register(self.p2p))
            except Exception as error:  # another auditor on this peer serves it already (a shared DHT peer)
                logger.warning("cannot take evidence over libp2p on peer %s: %r", self.p2p.peer_id, error)
                self._serving = False
        if self._serving:
            logger.info("taking clients' evidence over libp2p at peer id %s (%s)", self.p2p.peer_id,
                        "from anyone with a work stamp" if config.accept_evidence else "from --evidence-from only")
        self.embedding = files.embedding()  # the checkpoint's dtype, as a client's and the servers'
        self.dtype = next(self.embedding.parameters()).dtype
        self._blocks = None  # every block, loaded at the first check
        self.rng = random.SystemRandom()  # a server cannot predict a challenge's size, content or time
        self.audits: dict[str, ServerAudit] = {}  # what the report says of each server
        self.scores: dict[tuple[str, str], AdapterAudit] = {}  # (content sha256, task) -> its latest score
        self.speeds: dict[str, deque[float]] = {}  # peer -> throughput its last answered checks delivered
        self._client = None  # the swarm client that scores adapters, made at the first scoring
        self._round_dht = self.dht  # the DHT peer of this round's identity (challenger)
        self._traffic: Optional[TrafficIdentity] = None  # the identity rounds' traffic comes from, while kept
        reference = LocalReference(lambda start, end: self.blocks, lambda: self.head)
        audit_client = client_config(ClientConfig(network=config.network, dht_prefix=self.prefix,
                                                  request_timeout=config.request_timeout), config.sample)
        self.traffic = TrafficAuditor(files, self.prefix, audit_client, reference, self.rng)
        self._head = None
        self.sequence = 0
        self.rounds = 0

    def _caller(self, p2p) -> RemoteCaller:
        """A caller that stamps its calls as a default client does (swarm.wire.work), so its stamps do not tell it
        apart."""
        return RemoteCaller(p2p, stamper=stamper_for(str(p2p.peer_id), self.model))

    @property
    def blocks(self):
        """The auditor's own copy of the blocks (all of them: any server's span can be recomputed)."""
        if self._blocks is None:
            logger.info("loading blocks 0:%d of %s to check servers against", self.model.num_layers, self.files.path)
            self._blocks = self.files.span(0, self.model.num_layers)
        return self._blocks

    @property
    def head(self):
        """The auditor's own final norm and head (head servers' predictions are recomputed with it)."""
        if self._head is None:
            self._head = self.files.head()
        return self._head

    # ----- one challenge ---------------------------------------------------------------------------
    def challenge(self, start: int, end: int) -> ForwardRequest:
        """A forward call through ``start:end`` shaped like a client's uncached call of a generation in progress."""
        rng = self.rng
        limit = self.model.max_position_embeddings
        length = rng.randint(min(CHALLENGE_ROWS[0], limit), min(CHALLENGE_ROWS[1], limit))
        prompt = rng.randint(1, max(1, length // 2))
        masked = rng.random()  # the share of the generated part still masked: how far the generation has come
        ids = [rng.randrange(self.model.vocab_size) for _ in range(length)]
        for position in range(prompt, length):
            if rng.random() < masked:
                ids[position] = self.model.mask_token_id
        with torch.inference_mode():
            hidden = self.embedding(torch.tensor([ids]))
        return ForwardRequest(start, end, hidden, uuid.uuid4().hex, rng.randrange(CHALLENGE_STEPS))

    def expected(self, request: ForwardRequest) -> torch.Tensor:
        """What an honest server answers: the auditor's own pass through the same blocks, in the same dtype."""
        with torch.inference_mode():
            return self.blocks(request.hidden.to(self.dtype), blocks=(request.start, request.end)).to(self.dtype)

    def check(self, record: ServerRecord, servers: Optional[list[ServerRecord]] = None,
              lm: Optional[DistributedDiffusionLM] = None) -> list[Check]:
        """Ping the server, then send it ``challenges`` challenges through its announced span, one after another,
        each compared with the auditor's own pass; then (with the round's client ``lm``) ``generations`` whole
        generations through it with a sample of their calls recomputed. Stops at the first check that does not
        pass."""
        try:
            rtt, usage = self._ping(record)
        except RemoteError as error:
            return [Check(ERROR, f"ping: {error}"[:MAX_REASON_CHARS])]
        checks = []
        while len(checks) < self.config.challenges and (not checks or checks[-1].verdict == PASS):
            checks.append(dataclasses.replace(self._challenge(record, rtt), usage=usage))
        if lm is not None and self.config.generations and checks[-1].verdict == PASS:
            traffic = self.traffic.check(lm, record, servers or [record], self.config.generations)
            self.log_traffic(record, traffic)
            if traffic.verdict != PASS:  # the throughput figures stay the challenge's
                checks.append(dataclasses.replace(checks[-1], verdict=traffic.verdict, reason=traffic.reason))
        return checks

    @staticmethod
    def log_traffic(record: ServerRecord, traffic: TrafficCheck) -> None:
        log = logger.warning if traffic.verdict == FAIL else logger.info
        log("server %s: %d audit generations, %d of its calls recomputed (%s): %s%s", record.peer_id,
            traffic.generations, traffic.calls_checked, ", ".join(traffic.kinds) or "none", traffic.verdict.upper(),
            f" ({traffic.reason})" if traffic.reason else "")

    def _challenge(self, record: ServerRecord, rtt: float) -> Check:
        """One challenge through the server's announced span, compared with the auditor's own pass."""
        peer = record.peer_id
        request = self.challenge(record.start, record.end)
        started = time.perf_counter()
        try:
            output = self.loop.run(self.caller.forward(peer, request, self.config.request_timeout))
        except RemoteError as error:
            verdict = FAIL if error.code == ErrorCode.INTERNAL and "shape" in error.message else ERROR
            return Check(verdict, f"{error}"[:MAX_REASON_CHARS], request.rows, rtt)
        seconds = time.perf_counter() - started
        expected = self.expected(request)
        if not bool(torch.isfinite(output).all()):
            return Check(FAIL, f"non-finite values for blocks {record.start}:{record.end}", request.rows, rtt, seconds)
        if not answers_agree(output, expected, self.config.rtol):
            difference = relative_difference(output, expected)
            return Check(FAIL, f"wrong hidden states for blocks {record.start}:{record.end}: relative difference "
                               f"{difference:.3g} > {self.config.rtol:g}", request.rows, rtt, seconds)
        return Check(PASS, "", request.rows, rtt, seconds)

    def _ping(self, record: ServerRecord) -> tuple[float, Optional[tuple[int, float, int]]]:
        """The round trip of the server's info call (dialling its announced addresses if the daemon cannot reach
        it) and the usage totals it reports (tokens, compute seconds, requests; None when it gives none valid);
        RemoteError when it does not answer or serves another model."""
        timeout, peer = self.config.connect_timeout, record.peer_id
        info, rtt = self.loop.run(self.caller.dialing(peer, record.addresses, timeout,
                                                      lambda: self.caller.info(peer, timeout)))
        if info.get("prefix") != self.prefix:
            raise RemoteError(ErrorCode.WRONG_SPAN, f"serves {str(info.get('prefix'))[:60]!r}, not {self.prefix!r}",
                              peer)
        usage = parse_usage(info.get("usage"))
        total = usage["total"] if usage is not None else None
        return rtt, (total["tokens"], total["seconds"], total["requests"]) if total is not None else None

    # ----- adapters ---------------------------------------------------------------------------------
    @property
    def client(self):
        """A swarm client on the auditor's own DHT peer, trusting this auditor's reports (it avoids the servers the
        auditor failed), that generates with published adapters as any user would."""
        if self._client is None:
            config = ClientConfig(network=self.config.network, dht_prefix=self.prefix,
                                  request_timeout=self.config.request_timeout, trusted_auditors=(self.public_key,))
            self._client = DistributedDiffusionLM(self.files, config, dht=self.dht)
        return self._client

    def follow(self, findings: AuditReport) -> None:
        """Make the scoring client act on this round's findings before they are published: it avoids the servers
        just failed and routes overclaimers by their calibration (scoring through them would measure their lies)."""
        planner = self.client.planner
        planner.audits.consider(findings)
        try:
            planner.refresh()
            planner.build_route()
        except SwarmError as error:  # no route left (every holder failed): scoring will say so per adapter
            logger.warning("the scoring client has no route after this round's findings: %s", str(error)[:200])

    def score_adapters(self) -> dict[tuple[str, str], AdapterAudit]:
        """Score every published adapter (the first :data:`MAX_ADAPTERS`) on each task of ``score_adapters``; the
        scores made this round. An adapter that cannot be fetched or used (another base model, no host) is logged
        and skipped."""
        if not self.config.score_adapters:
            return {}
        made = {}
        published = published_versions(self.dht, self.prefix, MAX_CATALOG_NAMES)
        live = {record.sha256 for record in published}  # versions dropped or withdrawn are forgotten: bounded
        self.scores = {key: entry for key, entry in self.scores.items() if key[0] in live}
        for record in to_score(published, self.scores, MAX_ADAPTERS):
            reference = reference_of(record)  # this version exactly (swarm.adapters.versions)
            for task in self.config.score_adapters:
                seed = self.rng.randrange(2**31)  # held-out problems an author cannot know in advance
                # Fetch what the name holds now: a client keeps an adapter per name, and an author who republished
                # other content under it must not have the old content's score recorded for the new sha256.
                self.client.forget_adapter(reference)
                try:
                    result = evaluate_task(self.client, TASKS[task](), examples=self.config.task_examples, seed=seed,
                                           generate_options={"adapter": reference})
                except (AdapterError, SwarmError, ValueError) as error:
                    logger.warning("cannot score adapter %s on %s: %s", reference, task, str(error)[:200])
                    continue
                score = AdapterAudit(record.name, record.author, record.sha256, task, result.examples, result.correct,
                                     time.time(), record.score)
                made[(record.sha256, task)] = self.scores[(record.sha256, task)] = score
                logger.info("adapter %s on %s: %d/%d held-out problems exact (%.3f; its author claims %s)", reference,
                            task, result.correct, result.examples, score.score, record.score)
        return made

    # ----- rounds -----------------------------------------------------------------------------------
    def record(self, server: ServerRecord, check: Check, when: float) -> ServerAudit:
        """Add one check to what the auditor knows of the server."""
        held = self.audits.get(server.peer_id)
        counts = {PASS: 0, FAIL: 0, ERROR: 0} if held is None else {
            PASS: held.passed, FAIL: held.failed, ERROR: held.errors}
        counts[check.verdict] += 1
        last_failure = when if check.verdict == FAIL else (held.last_failure if held else None)
        reason = check.reason or (held.reason if held else "")
        audit = ServerAudit(server.peer_id, server.start, server.end, counts[PASS], counts[FAIL], counts[ERROR],
                            held.first_check if held else when, when, check.verdict, last_failure,
                            reason[:MAX_REASON_CHARS], server.throughput, check.measured, check.rtt, check.seconds,
                            check.rows, check.usage if check.usage is not None else (held.usage if held else None))
        self.audits[server.peer_id] = audit
        if check.measured is not None and check.verdict == PASS:
            self.speeds.setdefault(server.peer_id, deque(maxlen=SPEED_CHECKS)).append(check.measured)
        return audit

    def calibrated(self) -> dict[str, float]:
        """Per measured server, the throughput an honest server delivering its best would announce (:func:`calibrate`
        over the best of each server's last :data:`SPEED_CHECKS` answered checks)."""
        return calibrate({peer: max(speeds) for peer, speeds in self.speeds.items() if peer in self.audits},
                         {peer: audit.announced for peer, audit in self.audits.items()})

    def forget_old(self, now: float) -> None:
        """Forget servers not checked within a report's lifetime (they left, or were announced only to be checked
        once): what the auditor keeps stays bounded by the servers it checks, however many ids come and go."""
        horizon = now - self.config.report_lifetime
        for peer in [peer for peer, audit in self.audits.items() if audit.last_check < horizon]:
            del self.audits[peer]
            self.speeds.pop(peer, None)

    def report(self) -> AuditReport:
        """The report of everything checked so far (the :data:`MAX_SERVERS` checked last), newer than the last."""
        now = time.time()
        self.forget_old(now)
        self.sequence = max(self.sequence + 1, int(now * 1000))
        calibrated = self.calibrated()
        servers = sorted((dataclasses.replace(audit, calibrated=calibrated.get(peer)) for peer, audit
                          in self.audits.items()), key=lambda a: a.last_check, reverse=True)[:MAX_SERVERS]
        scores = reported_scores(self.scores.values(), MAX_ADAPTERS)
        while True:  # within the size bound too (32 long entries and 16 scores): the oldest checks go first
            report = AuditReport(self.prefix, self.sequence, now, tuple(sorted(servers, key=lambda a: a.peer_id)),
                                 self.public_key, scores)
            try:
                report.payload()
                return report
            except ValueError:
                servers = servers[:-1]

    @contextlib.contextmanager
    def challenger(self) -> Iterator[str]:
        """The peer this round's challenges come from (its id): the traffic identity, a DHT peer of its own with a
        fresh key kept for ``identity_lifetime`` seconds across rounds (0: one per round), or with ``fresh_identity``
        off the auditor's own. ``self.caller`` calls through it meanwhile."""
        if not self.config.fresh_identity:
            yield str(self.dht.peer_id)
            return
        now = time.monotonic()
        if self._traffic is not None and now >= self._traffic.renew_at:
            self._stop_traffic()
        if self._traffic is None:
            network = dataclasses.replace(self.config.network, identity_path=None, client_mode=True)
            dht = start_dht(network)
            lifetime = self.config.identity_lifetime * self.rng.uniform(1 - self.config.jitter, 1 + self.config.jitter)
            self._traffic = TrafficIdentity(dht, self._caller(self.loop.run(dht.replicate_p2p())), now + lifetime)
            logger.info("traffic identity %s, kept %.0f s", dht.peer_id, lifetime)
        own, self.caller, self._round_dht = self.caller, self._traffic.caller, self._traffic.dht
        try:
            yield str(self._traffic.dht.peer_id)
        finally:
            self._round_dht, self.caller = self.dht, own
            if self.config.identity_lifetime == 0:
                self._stop_traffic()

    def _stop_traffic(self) -> None:
        traffic, self._traffic = self._traffic, None
        if traffic is None:
            return
        stop_dht(traffic.dht)  # closes its connection to the daemon first

    @contextlib.contextmanager
    def round_client(self) -> Iterator[Optional[DistributedDiffusionLM]]:
        """A swarm client of this round's identity for the audit generations (None with ``generations`` 0): made per
        round, so what it learnt of servers (a liar distrusted) does not carry over into the next round's checks."""
        if not self.config.generations:
            yield None
            return
        lm = self.traffic.client(self._round_dht)
        try:
            yield lm
        finally:
            lm.shutdown()  # shares the round's DHT peer: stops nothing of it

    def run_round(self, score: bool = True) -> RoundResult:
        """Check every online server once, in random order (from this round's identity), score the published adapters
        (when configured and ``score``), then publish the report."""
        started = time.perf_counter()
        servers = [r for r in read_servers(self.dht, self.prefix, self.model.num_layers).values()
                   if r.state == ServerState.ONLINE]
        self.rng.shuffle(servers)
        checked: dict[str, Check] = {}
        with self.challenger() as identity, self.round_client() as lm:
            logger.debug("challenging %d servers as %s", min(len(servers), MAX_SERVERS), identity)
            found = {server.peer_id: self.check(server, servers, lm) for server in servers[:MAX_SERVERS]}
        for server in servers[:MAX_SERVERS]:
            for check in found[server.peer_id]:
                audit = self.record(server, check, time.time())
            checked[server.peer_id] = check  # the last: the one that did not pass, if any
            log = logger.warning if check.verdict != PASS else logger.info
            log("server %s (blocks %d:%d): %s%s; %s rows in %s s, announced %.1f tok/s, measured %s tok/s",
                server.peer_id, server.start, server.end, check.verdict.upper(),
                f" ({check.reason})" if check.reason else "", check.rows,
                "-" if check.seconds is None else f"{check.seconds:.3f}", server.throughput,
                "-" if audit.measured is None else f"{audit.measured:.1f}")
        self.take_evidence(servers, checked)
        if score and self.config.score_adapters:
            self.follow(self.report())
            self.score_adapters()
        report = self.report()
        for entry in report.servers:
            if entry.overclaim is not None and entry.overclaim > DEFAULT_OVERCLAIM_FACTOR:
                logger.warning("server %s announces %.0f tok/s, %.1fx what its delivery calibrates to (%.0f tok/s): "
                               "clients trusting this auditor route it by the calibration", entry.peer_id,
                               entry.announced, entry.overclaim, entry.calibrated)
        published = publish_report(self.dht, self.key, report, self.config.report_lifetime)
        self.rounds += 1
        seconds = time.perf_counter() - started
        verdicts = [c.verdict for c in checked.values()]
        logger.info("round %d: %d servers checked (%d pass, %d fail, %d error) in %.2f s; report #%d %s",
                    self.rounds, len(checked), verdicts.count(PASS), verdicts.count(FAIL), verdicts.count(ERROR),
                    seconds, report.sequence, "published" if published else "NOT read back from the swarm")
        return RoundResult(published or report, checked, published is not None, seconds)

    def take_evidence(self, servers: list[ServerRecord], checked: dict[str, Check]) -> list[Finding]:
        """Recompute the clients' evidence waiting in ``--evidence-dir`` (:mod:`swarm.audit.inbox`) and handed over
        libp2p (:mod:`swarm.audit.handoff`), up to :data:`~swarm.audit.inbox.MAX_FILES_PER_ROUND` of each: a proven
        lie fails the accused (when it is an online server) with the proof kept; every finding is logged and
        returned."""
        online = {server.peer_id: server for server in servers}
        judge = functools.partial(self._judge, LocalReference(lambda start, end: self.blocks, lambda: self.head),
                                  online, checked)
        findings = []
        directory = Path(self.config.evidence_dir) if self.config.evidence_dir is not None else None
        if directory is not None:
            for path, evidence in inbox.take(directory):
                findings.append(judge(evidence, f"file {path.name}", lambda path=path: inbox.keep_proof(path).name))
                if findings[-1].verdict != Verdict.LIE:
                    path.unlink(missing_ok=True)
        taken = self.loop.run(_on_loop(lambda: self.handed.queue.take(inbox.MAX_FILES_PER_ROUND)))
        for caller, evidence in taken:
            findings.append(judge(evidence, f"handed by {caller}", lambda evidence=evidence: self._keep(evidence)))
        return findings

    def _judge(self, reference: LocalReference, online: dict[str, ServerRecord], checked: dict[str, Check],
               evidence: CallEvidence, source: str, keep: Callable[[], str]) -> Finding:
        """Recompute one piece of evidence; a proven lie is kept (``keep`` names where) and fails its accused."""
        finding = verify_evidence(evidence, reference, self.prefix, self.model, self.config.rtol)
        logger.log(logging.WARNING if finding.verdict == Verdict.LIE else logging.INFO,
                   "evidence %s: %s %s (%s)", source, finding.verdict.value, finding.accused, finding.reason)
        if finding.verdict == Verdict.LIE:
            kept = keep()
            server = online.get(finding.accused)
            if server is not None:
                check = Check(FAIL, f"proven on a client's call ({kept}): {finding.reason}")
                self.record(server, check, time.time())
                checked[server.peer_id] = check
        return finding

    def _keep(self, evidence: CallEvidence) -> str:
        """Keep a proof handed over libp2p: in memory (:attr:`proofs`), and in ``--evidence-dir``'s ``proofs/``
        when there is one; its name."""
        self.proofs.append(evidence)
        if self.config.evidence_dir is None:
            return f"proof {evidence.receipt.request.hex()[:32]}"
        return save_sample([evidence], Path(self.config.evidence_dir) / inbox.PROOFS)[0].name

    def pause(self) -> float:
        """Seconds until the next round: ``every`` x (1 +- jitter), drawn so servers cannot time the checks."""
        jitter = self.config.jitter
        return self.config.every * self.rng.uniform(1 - jitter, 1 + jitter)

    def run(self, stop: Optional[threading.Event] = None) -> RoundResult:
        """Rounds until ``stop`` is set (or one with ``once``); the last round's result."""
        stop = stop or threading.Event()
        while True:
            result = self.run_round()
            if self.config.once or stop.wait(self.pause()):
                return result

    def shutdown(self) -> None:
        if self._serving:
            self._serving = False
            try:
                self.loop.run(self.handed.unregister(self.p2p), timeout=5)
            except Exception as error:  # the daemon is gone already: nothing left to unregister
                logger.debug("could not unregister the evidence handler: %r", error)
        self._stop_traffic()
        if self._client is not None:
            self._client.shutdown()  # shares this auditor's DHT: stops nothing of it
        if self._own_dht:
            stop_dht(self.dht)  # closes its connection to the daemon first

    def __enter__(self) -> "Auditor":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
