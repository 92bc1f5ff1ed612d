"""Signed audit reports on the DHT, and what a reader that trusts some auditors makes of them.

An auditor (``python -m swarm.audit``) holds an Ed25519 key, made like a governance key. Its report lives under
``{prefix}.audits.{PUBLIC KEY}`` in the key's signed slot (``swarm.dht.validation``, as governance decisions and
adapter records): every swarm peer refuses a write there that the key did not sign over the DHT key, the payload and
the expiration time, and a peer that knows the auditor (it trusts it, or it is one of the governance keys it trusts:
``swarm.dht.schema.protected_keys``) keeps nothing else under that key. A new report replaces the auditor's previous
one (a later expiration); it lives at most :data:`~swarm.dht.config.MAX_AUDIT_LIFETIME`.

The payload (msgpack) holds the prefix, a sequence number (the auditor's clock in milliseconds, above its previous
report's), the time it was published and, per audited server (at most :data:`MAX_SERVERS`), its checks passed,
failed and errored, the first and last check's times, the last check's verdict, the time and reason of its last
failure, the last check's announced and measured throughput, round trip and call time, and the server's own usage
totals (tokens, compute seconds, requests: what its ``rpc_info`` says, unchecked); and per published adapter
content and task (at most :data:`MAX_ADAPTERS`) the held-out problems it answered exactly of those asked, beside the
score its author claimed. :meth:`AuditReport.payload` refuses to encode more than :data:`MAX_REPORT_BYTES`;
:meth:`AuditReport.from_payload` parses with ``swarm.utils.fields`` (every number finite and in range, texts cut,
counts capped, times not in the future, fields consistent with each other) and raises ValueError for anything else;
the readers turn that into "no report", so no record can make a reader raise.

Readers name the auditors they trust (:func:`trusted_auditors`: ``ClientConfig.trusted_auditors``, default the
governance keys). :class:`AuditBook` keeps each trusted auditor's newest report and never goes back to an older one
(a replayed report cannot undo a newer verdict), and answers, per server, the most recent check any trusted auditor
made of it: a server whose most recent check *failed* (a wrong answer) is avoided by the client like a banned one;
``adapter="best:TASK"`` takes the published adapter whose content has the best trusted score
(:meth:`AuditBook.best_adapter`). Reports signed by any other key are never read.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht import DHT
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.adapters.block import is_sha256_hex
from swarm.adapters.sharing import MAX_SCORE, NAME_PATTERN, author_id, signed_entries, store_slot
from swarm.dht.config import MAX_BLOCKS, MAX_PEER_ID_CHARS
from swarm.dht.schema import MAX_AUDIT_LIFETIME, audit_key, forget_local_copies
from swarm.dht.validation import MAX_SLOT_PAYLOAD, ed25519_public_key, ed25519_text
from swarm.governance.keys import parse_public_key, public_key_text, trusted_key_texts
from swarm.utils import fields

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
PASS, FAIL, ERROR = "pass", "fail", "error"  # the last check: right answer, wrong answer, no answer
VERDICTS = (PASS, FAIL, ERROR)
MAX_SERVERS = 32  # servers one report lists (an auditor of a larger swarm lists those it checked last)
MAX_REPORT_BYTES = MAX_SLOT_PAYLOAD  # 16 KiB: a full report (32 servers, longest ids, reasons, usage) is ~15.7 KiB
MAX_REASON_CHARS = 100
MAX_PREFIX_CHARS = 256
MAX_COUNT = 2**53
MAX_SEQUENCE = 2**53
MAX_THROUGHPUT = 1e12  # tokens per second, as server records bound it
MIN_THROUGHPUT = 1e-3  # what routing assumes at least of any server (swarm.client.routing)
MAX_SECONDS = 1e6  # a round trip or a call's time
MAX_USAGE_SECONDS = 1e12  # compute seconds a server reports having spent on its callers
MAX_CLOCK_SKEW = 300.0  # seconds a report's times may be ahead of the reader's clock
MAX_REPORT_KEYS = 8  # fields of a report map; a server entry has at most MAX_ENTRY_KEYS
MAX_ENTRY_KEYS = 20
NO_AUDITORS = "none"  # trusted_auditors=("none",): trust no auditor, not even the governance keys
MAX_ADAPTERS = 16  # adapter scores one report lists
MAX_TASK_CHARS = 32
MAX_EXAMPLES = 100_000
BEST = "best:"  # adapter="best:TASK": the published adapter with the best trusted audited score on TASK


@dataclass(frozen=True)
class ServerAudit:
    """What one auditor found about one server, over every check it made of it."""

    peer_id: str
    start: int
    end: int  # the span checked (end exclusive): the one the server announced at the last check
    passed: int
    failed: int  # checks answered wrongly
    errors: int  # checks not answered (unreachable, refused, timed out)
    first_check: float  # seconds since the epoch, the auditor's clock
    last_check: float
    verdict: str  # of the last check: pass, fail or error
    last_failure: Optional[float] = None  # time of the last failed check
    reason: str = ""  # why the last check that did not pass did not
    announced: float = 0.0  # tokens per second the server's record announced at the last check
    measured: Optional[float] = None  # tokens per second the last check delivered (rows / call time, ping included)
    rtt: Optional[float] = None  # seconds of the last check's ping
    seconds: Optional[float] = None  # seconds the last check's forward call took
    rows: int = 0  # positions the last check sent
    # the server's own totals at the last ping that gave them (rpc_info's usage: tokens as rows x blocks, compute
    # seconds, requests), as the server says: not checked by the auditor
    usage: Optional[tuple[int, float, int]] = None
    # tokens per second an honest server delivering what this one delivered would announce: its best measured
    # figure of recent checks x the median announced / measured ratio of the servers in the report (None: never
    # measured). Readers route with it instead of ``announced`` when that is far above it (``overclaim``).
    calibrated: Optional[float] = None

    @property
    def overclaim(self) -> Optional[float]:
        """How many times ``calibrated`` the server announced at the last check (None without a calibration)."""
        return self.announced / max(self.calibrated, MIN_THROUGHPUT) if self.calibrated is not None else None

    @property
    def is_failed(self) -> bool:
        """The last check found a wrong answer (an error is no verdict on honesty)."""
        return self.verdict == FAIL

    def to_value(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "blocks": [self.start, self.end], "passed": self.passed,
                "failed": self.failed, "errors": self.errors, "first_check": self.first_check,
                "last_check": self.last_check, "verdict": self.verdict, "last_failure": self.last_failure,
                "reason": self.reason, "announced": self.announced, "measured": self.measured, "rtt": self.rtt,
                "seconds": self.seconds, "rows": self.rows,
                **({"usage": list(self.usage)} if self.usage is not None else {}),
                **({"calibrated": self.calibrated} if self.calibrated is not None else {})}

    def to_json(self) -> dict[str, Any]:
        value = self.to_value()
        value["usage"] = None if self.usage is None else dict(zip(("tokens", "seconds", "requests"), self.usage))
        value["calibrated"], value["overclaim"] = self.calibrated, self.overclaim
        return value

    @classmethod
    def from_value(cls, raw: Any, latest: float) -> "ServerAudit":
        """One entry, every field checked; ValueError saying why not. ``latest``: the newest time accepted."""
        if not isinstance(raw, dict) or len(raw) > MAX_ENTRY_KEYS:
            raise ValueError(f"a server entry is a map of at most {MAX_ENTRY_KEYS} fields")
        blocks = raw.get("blocks")
        if not isinstance(blocks, list) or len(blocks) != 2:
            raise ValueError("blocks must be [start, end]")
        start, end = fields.integer(blocks[0], 0, MAX_BLOCKS), fields.integer(blocks[1], 1, MAX_BLOCKS)
        if not start < end:
            raise ValueError(f"bad span {start}:{end}")
        peer_id = fields.text(raw.get("peer_id"), MAX_PEER_ID_CHARS + 1)
        if not peer_id or len(peer_id) > MAX_PEER_ID_CHARS:
            raise ValueError(f"a peer id is 1-{MAX_PEER_ID_CHARS} characters")
        timestamp = lambda name: fields.number(raw.get(name), 0.0, latest)  # noqa: E731
        optional = lambda name, high: None if raw.get(name) is None else fields.number(raw.get(name), 0.0, high)  # noqa: E731
        entry = cls(peer_id, start, end, fields.integer(raw.get("passed"), 0, MAX_COUNT),
                    fields.integer(raw.get("failed"), 0, MAX_COUNT), fields.integer(raw.get("errors"), 0, MAX_COUNT),
                    timestamp("first_check"), timestamp("last_check"), fields.text(raw.get("verdict"), 8),
                    optional("last_failure", latest), fields.text(raw.get("reason", ""), MAX_REASON_CHARS),
                    fields.number(raw.get("announced"), 0.0, MAX_THROUGHPUT), optional("measured", MAX_THROUGHPUT),
                    optional("rtt", MAX_SECONDS), optional("seconds", MAX_SECONDS),
                    fields.integer(raw.get("rows", 0), 0, MAX_COUNT), _usage(raw.get("usage")),
                    optional("calibrated", MAX_THROUGHPUT))
        entry.check()
        return entry

    def check(self) -> None:
        """The fields agree with each other (what a well-behaved auditor writes); ValueError otherwise."""
        if self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict[:8]!r}")
        counts = {PASS: self.passed, FAIL: self.failed, ERROR: self.errors}
        if counts[self.verdict] < 1:
            raise ValueError(f"the last check's verdict {self.verdict!r} is not among the counted checks")
        if not self.first_check <= self.last_check:
            raise ValueError("the first check is after the last one")
        if (self.last_failure is None) != (self.failed == 0):
            raise ValueError("a time of the last failure goes with failed checks, and only with them")
        if self.last_failure is not None and not self.first_check <= self.last_failure <= self.last_check:
            raise ValueError("the last failure is outside the checks' times")
        if self.verdict == FAIL and self.last_failure != self.last_check:
            raise ValueError("a failed last check is the last failure")


def _usage(raw: Any) -> Optional[tuple[int, float, int]]:
    """A server entry's ``usage``: absent (None), or [tokens, compute seconds, requests]."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != 3:
        raise ValueError("usage must be [tokens, seconds, requests]")
    return (fields.integer(raw[0], 0, MAX_COUNT), fields.number(raw[1], 0.0, MAX_USAGE_SECONDS),
            fields.integer(raw[2], 0, MAX_COUNT))


@dataclass(frozen=True)
class AdapterAudit:
    """What one auditor measured of one published adapter on one held-out task (``swarm.eval``'s exact match)."""

    name: str  # the published name
    author: str  # the author's Ed25519 public key (base64), whose record was scored
    sha256: str  # the content scored: a record republished with other content is not covered
    task: str
    examples: int
    correct: int
    checked: float  # when it was scored, the auditor's clock
    claimed: Optional[float] = None  # the score the author's record claimed then

    @property
    def score(self) -> float:
        return self.correct / self.examples

    @property
    def reference(self) -> str:
        """``name@AUTHOR``: what ``adapter=`` takes to use exactly this author's record."""
        return f"{self.name}@{author_id(self.author)}"

    def to_value(self) -> dict[str, Any]:
        return {"name": self.name, "author": self.author, "sha256": self.sha256, "task": self.task,
                "examples": self.examples, "correct": self.correct, "checked": self.checked, "claimed": self.claimed}

    def to_json(self) -> dict[str, Any]:
        return dict(self.to_value(), score=self.score, reference=self.reference)

    @classmethod
    def from_value(cls, raw: Any, latest: float) -> "AdapterAudit":
        """One adapter entry, every field checked; ValueError saying why not."""
        if not isinstance(raw, dict) or len(raw) > MAX_ENTRY_KEYS:
            raise ValueError(f"an adapter entry is a map of at most {MAX_ENTRY_KEYS} fields")
        name, author, sha = raw.get("name"), raw.get("author"), raw.get("sha256")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise ValueError("an adapter name is 1-64 letters, digits, '_', '.' or '-'")
        if not isinstance(author, str) or len(author) > 64:
            raise ValueError("an author is an Ed25519 public key")
        ed25519_public_key(author)  # ValueError when it is not one
        if not is_sha256_hex(sha):
            raise ValueError("sha256 must be 64 hex digits")
        task = fields.text(raw.get("task"), MAX_TASK_CHARS + 1)
        if not task or len(task) > MAX_TASK_CHARS:
            raise ValueError(f"a task name is 1-{MAX_TASK_CHARS} characters")
        examples = fields.integer(raw.get("examples"), 1, MAX_EXAMPLES)
        claimed = raw.get("claimed")
        return cls(name, author, sha, task, examples, fields.integer(raw.get("correct"), 0, examples),
                   fields.number(raw.get("checked"), 0.0, latest),
                   None if claimed is None else fields.number(claimed, -MAX_SCORE, MAX_SCORE))


@dataclass(frozen=True)
class AuditReport:
    """One auditor's report on the servers of one model (see the module doc)."""

    prefix: str
    sequence: int
    published: float
    servers: tuple[ServerAudit, ...] = ()
    auditor: str = ""  # the signing key (base64), filled in from the slot when read
    adapters: tuple[AdapterAudit, ...] = ()  # published adapters' measured scores

    def payload(self) -> bytes:
        """The signed bytes; ValueError when the report breaks a bound readers enforce (count, size)."""
        if len(self.servers) > MAX_SERVERS:
            raise ValueError(f"a report lists at most {MAX_SERVERS} servers, not {len(self.servers)}")
        if len({s.peer_id for s in self.servers}) != len(self.servers):
            raise ValueError("a report lists each server once")
        if len(self.adapters) > MAX_ADAPTERS:
            raise ValueError(f"a report lists at most {MAX_ADAPTERS} adapter scores, not {len(self.adapters)}")
        if len({(a.sha256, a.task) for a in self.adapters}) != len(self.adapters):
            raise ValueError("a report scores each adapter content once per task")
        payload = MSGPackSerializer.dumps({
            "record_version": RECORD_VERSION, "prefix": self.prefix, "sequence": self.sequence,
            "published": self.published, "servers": [s.to_value() for s in self.servers],
            "adapters": [a.to_value() for a in self.adapters]})
        if len(payload) > MAX_REPORT_BYTES:
            raise ValueError(f"a report of {len(payload)} bytes is over the bound of {MAX_REPORT_BYTES}")
        return payload

    @classmethod
    def from_payload(cls, payload: Any, auditor: str, prefix: str, now: Optional[float] = None) -> "AuditReport":
        """Parse a verified payload for ``prefix``; ValueError for anything malformed, oversized, from the future or
        for another model (its auditor may still be careless or hostile)."""
        body = fields.record_body(payload, MAX_REPORT_BYTES, RECORD_VERSION, MAX_REPORT_KEYS, "an audit report")
        claimed = fields.text(body.get("prefix"), MAX_PREFIX_CHARS)
        if claimed != prefix:
            raise ValueError(f"a report for prefix {claimed[:80]!r}, not {prefix[:80]!r}")
        latest = (time.time() if now is None else now) + MAX_CLOCK_SKEW
        servers = body.get("servers")
        if not isinstance(servers, list) or len(servers) > MAX_SERVERS:
            raise ValueError(f"servers must be a list of at most {MAX_SERVERS} entries")
        entries = tuple(ServerAudit.from_value(raw, latest) for raw in servers)
        if len({e.peer_id for e in entries}) != len(entries):
            raise ValueError("a server is listed twice")
        adapters = body.get("adapters", [])
        if not isinstance(adapters, list) or len(adapters) > MAX_ADAPTERS:
            raise ValueError(f"adapters must be a list of at most {MAX_ADAPTERS} entries")
        scores = tuple(AdapterAudit.from_value(raw, latest) for raw in adapters)
        if len({(a.sha256, a.task) for a in scores}) != len(scores):
            raise ValueError("an adapter content is scored twice for one task")
        published = fields.number(body.get("published"), 0.0, latest)
        if any(e.last_check > published for e in entries) or any(a.checked > published for a in scores):
            raise ValueError("a check is dated after the report")
        return cls(claimed, fields.integer(body.get("sequence"), 0, MAX_SEQUENCE), published, entries, auditor,
                   scores)

    def server(self, peer_id: str) -> Optional[ServerAudit]:
        return next((s for s in self.servers if s.peer_id == peer_id), None)

    def to_json(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "auditor": self.auditor, "sequence": self.sequence,
                "published": self.published, "servers": [s.to_json() for s in self.servers],
                "adapters": [a.to_json() for a in self.adapters]}


# ----- on the DHT ---------------------------------------------------------------------------------------
def read_report(dht: DHT, prefix: str, auditor: str) -> Optional[AuditReport]:
    """The report ``auditor`` (base64 public key) signed for ``prefix``, or None (none, or nothing valid: slots of
    other keys, bad signatures and malformed payloads are ignored)."""
    for signer, payload in signed_entries(dht, audit_key(prefix, auditor)):
        if signer != auditor:
            continue  # another key's slot under this auditor's key: never its report
        try:
            return AuditReport.from_payload(payload, signer, prefix)
        except Exception as error:  # remote input: whatever went wrong, it is not a report
            logger.debug("ignoring a malformed audit report by %s: %s", auditor[:12], str(error)[:200])
    return None


def publish_report(dht: DHT, key: Ed25519PrivateKey, report: AuditReport, lifetime: float,
                   tries: int = 5) -> Optional[AuditReport]:
    """Sign and store ``report`` in ``key``'s slot for ``lifetime`` seconds (at most a day); the report as readers
    get it back from other peers, or None when they do not (after ``tries`` reads, half a second apart)."""
    lifetime = min(lifetime, MAX_AUDIT_LIFETIME - 60.0)
    auditor = ed25519_text(key)
    dht_key = audit_key(report.prefix, auditor)
    for attempt in range(tries):
        store_slot(dht, key, dht_key, report.payload(), get_dht_time() + lifetime)
        forget_local_copies(dht, [dht_key])  # what readers get, not this peer's own copy
        read = read_report(dht, report.prefix, auditor)
        if read is not None and read.sequence == report.sequence:
            return read
        time.sleep(0.5 * (attempt + 1))
    return None


# ----- readers ------------------------------------------------------------------------------------------
def trusted_auditors(keys: Iterable[str] = (), governance_keys: Iterable[str] = ()) -> list[str]:
    """The auditors a reader trusts, as base64 keys: ``keys`` (base64 or files holding one; a value may hold several
    separated by commas or spaces), else the governance keys (given, else ``$SWARM_GOVERNANCE_KEYS``); ``("none",)``
    trusts no auditor. ValueError naming a key that is not one."""
    texts = [part for key in keys for part in str(key).replace(",", " ").split()]
    if texts == [NO_AUDITORS]:
        return []
    if NO_AUDITORS in texts:
        raise ValueError(f"trusted auditors: {NO_AUDITORS!r} (trust none) cannot go with keys")
    texts = texts or trusted_key_texts(governance_keys)
    return sorted({public_key_text(parse_public_key(text)) for text in texts})


@dataclass
class AuditBook:
    """The newest valid report of each trusted auditor for one model (see the module doc)."""

    prefix: str
    trusted: frozenset[str]
    reports: dict[str, AuditReport] = field(default_factory=dict)
    # a client's route planner and a web map's watcher refresh one book from their own threads
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def enabled(self) -> bool:
        return bool(self.trusted)

    def consider(self, report: AuditReport) -> bool:
        """Adopt ``report`` if a trusted auditor signed it for this model and it is newer than the one held."""
        if report.auditor not in self.trusted or report.prefix != self.prefix:
            return False
        with self._lock:
            held = self.reports.get(report.auditor)
            if held is not None and held.sequence >= report.sequence:
                return False
            self.reports = {**self.reports, report.auditor: report}  # readers iterate a dict nobody changes
        return True

    def refresh(self, dht: DHT) -> None:
        """Read each trusted auditor's report (never raises: an unreadable DHT keeps what is held)."""
        for auditor in sorted(self.trusted):
            try:
                report = read_report(dht, self.prefix, auditor)
            except Exception as error:  # an unreachable DHT must not stop the reader
                logger.warning("could not read the audit report of %s: %r", auditor[:12], error)
                continue
            if report is not None:
                self.consider(report)

    def latest(self) -> dict[str, tuple[str, ServerAudit]]:
        """Per server peer id, (auditor, entry) of the most recent check a trusted auditor made of it."""
        found: dict[str, tuple[str, ServerAudit]] = {}
        for auditor, report in sorted(self.reports.items()):
            for entry in report.servers:
                held = found.get(entry.peer_id)
                if held is None or entry.last_check > held[1].last_check:
                    found[entry.peer_id] = (auditor, entry)
        return found

    def adapter_scores(self) -> dict[tuple[str, str], tuple[str, AdapterAudit]]:
        """Per (adapter content sha256, task), (auditor, entry) of the most recent trusted score."""
        found: dict[tuple[str, str], tuple[str, AdapterAudit]] = {}
        for auditor, report in sorted(self.reports.items()):
            for entry in report.adapters:
                held = found.get((entry.sha256, entry.task))
                if held is None or entry.checked > held[1].checked:
                    found[(entry.sha256, entry.task)] = (auditor, entry)
        return found

    def calibrated(self) -> dict[str, tuple[str, float]]:
        """Per server, (auditor, calibrated throughput) of the most recent trusted check that measured it."""
        return {peer: (auditor, max(entry.calibrated, MIN_THROUGHPUT)) for peer, (auditor, entry)
                in self.latest().items() if entry.calibrated is not None}

    def failed(self) -> dict[str, str]:
        """Servers whose most recent trusted check found a wrong answer, with why (for the client's log)."""
        return {peer: f"auditor {auditor[:12]}... failed it at {time.strftime('%H:%M:%S', time.gmtime(e.last_check))}"
                      f" UTC: {e.reason}" for peer, (auditor, e) in self.latest().items() if e.is_failed}


def adapter_audits_json(book: AuditBook, sha256: str) -> dict[str, dict[str, Any]]:
    """What the health map shows of an adapter content's trusted scores: per task, the latest (with its auditor)."""
    return {task: dict(entry.to_json(), auditor=auditor)
            for (sha, task), (auditor, entry) in sorted(book.adapter_scores().items()) if sha == sha256}


def audit_json(latest: Mapping[str, tuple[str, ServerAudit]], peer_id: str) -> Optional[dict[str, Any]]:
    """What the health map shows of a server's latest trusted audit (None: no trusted auditor checked it)."""
    if peer_id not in latest:
        return None
    auditor, entry = latest[peer_id]
    return dict(entry.to_json(), auditor=auditor)
