"""Use management: what a server computed for each caller, and a cap on one caller's share over a sliding window.

Every span call computed here is charged to its caller (the libp2p peer id of the calling client): its tokens (rows
x blocks: batch x length positions through each block computed) and its compute seconds (the time its pass held the
compute thread, queueing excluded, so a caller is never charged for waiting behind another). :class:`UsageLedger`
keeps totals since start per caller and, for the cap, the compute seconds of the last ``window`` seconds in
``BUCKETS`` time buckets.

The share (``--max-share-per-caller``, 1 = none) is an order, not a refusal: a caller whose compute seconds in the
window are over ``max_share`` of everything the server computed in the window is served after the callers within
their share (:class:`~swarm.server.scheduler.FairScheduler`), and at once when nobody else waits. Refusing it instead
let a stranger's one tiny call keep a heavy user out while the server sat idle (issue 48); ``refused`` stays in the
counts for readers of older servers and is 0 here.

Bounded in count and time: at most ``max_callers`` callers are tracked (the least recently served forgotten first,
their totals kept in the server's total), and a caller's window holds at most ``BUCKETS + 1`` buckets, each dropped
once older than the window. A stranger cycling peer ids costs a bounded amount of memory and only evicts the oldest
records; fresh ids gain nothing in the order either, as they share one newcomers' flow in the scheduler. Pure: no
sockets, the clock is passed in.
"""
from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Optional

from swarm.utils import fields

BUCKETS = 16  # time buckets per window: the window slides in steps of window / BUCKETS
MAX_CALLERS = 1024  # callers tracked at once
TOP_CALLERS = 32  # callers rpc_info lists (the heaviest by tokens)
MAX_PEER_ID_CHARS = 64  # a libp2p id in base58 is 46-53 characters


@dataclass
class Window:
    """Compute seconds (and tokens) in time buckets: ``(bucket start, seconds, tokens)``, oldest first."""

    buckets: deque = field(default_factory=deque)
    seconds: float = 0.0
    tokens: int = 0

    def add(self, start: float, seconds: float, tokens: int) -> None:
        """Add to the bucket starting at ``start``; a clock that went back adds to the newest bucket instead, so the
        buckets stay in order and bounded in number."""
        if self.buckets and self.buckets[-1][0] >= start:
            newest, old_seconds, old_tokens = self.buckets.pop()
            self.buckets.append((newest, old_seconds + seconds, old_tokens + tokens))
        else:
            self.buckets.append((start, seconds, tokens))
        self.seconds += seconds
        self.tokens += tokens

    def expire(self, oldest: float) -> None:
        """Drop the buckets that started before ``oldest``."""
        while self.buckets and self.buckets[0][0] < oldest:
            _, seconds, tokens = self.buckets.popleft()
            self.seconds -= seconds
            self.tokens -= tokens
        if not self.buckets:  # no drift from float sums
            self.seconds, self.tokens = 0.0, 0


@dataclass
class CallerUsage:
    """One caller's totals since it was first served here (or tracked again), and its recent window."""

    tokens: int = 0
    seconds: float = 0.0
    requests: int = 0
    refused: int = 0  # refused for being over its share: never since the share became an order (kept for readers)
    first: float = 0.0
    last: float = 0.0
    window: Window = field(default_factory=Window)


class UsageLedger:
    """Per-caller accounting and the share cap (see the module doc). ``now`` is passed in (``time.time()``)."""

    def __init__(self, max_share: float = 1.0, window: float = 60.0, max_callers: int = MAX_CALLERS,
                 top: int = TOP_CALLERS):
        if not 0 < max_share <= 1:
            raise ValueError(f"max_share must be in (0, 1], got {max_share}")
        if not window > 0 or max_callers < 1 or top < 1:
            raise ValueError(f"window must be above 0 and max_callers, top at least 1, got {window}, {max_callers}, "
                             f"{top}")
        self.max_share, self.window, self.max_callers, self.top = max_share, window, max_callers, top
        self.step = window / BUCKETS
        self.callers: OrderedDict[str, CallerUsage] = OrderedDict()  # least recently served first
        self.total = CallerUsage()  # every caller's, forgotten ones included
        self.forgotten = 0  # callers evicted to keep at most max_callers
        self.expired_at: Optional[float] = None  # the bucket of the last expiry: nothing more leaves before the next
        self.refused = 0

    def _bucket(self, now: float) -> float:
        return math.floor(now / self.step) * self.step

    def _expire(self, now: float) -> None:
        if self._bucket(now) == self.expired_at:  # within the same bucket nothing more leaves the window
            return
        self.expired_at = self._bucket(now)
        oldest = self._bucket(now) - self.window + self.step  # the window: the current bucket and BUCKETS - 1 before
        self.total.window.expire(oldest)
        for usage in self.callers.values():
            usage.window.expire(oldest)

    def record(self, caller: str, tokens: int, seconds: float, now: float) -> None:
        """Charge ``caller`` for one computed call: ``tokens`` rows x blocks, ``seconds`` of compute."""
        tokens, seconds = max(0, int(tokens)), max(0.0, float(seconds))
        usage = self.callers.pop(caller, None)
        if usage is None:
            usage = CallerUsage(first=now)
            while len(self.callers) >= self.max_callers:
                self.callers.popitem(last=False)
                self.forgotten += 1
        self.callers[caller] = usage  # most recently served last
        bucket = self._bucket(now)
        for entry in (usage, self.total):
            entry.tokens += tokens
            entry.seconds += seconds
            entry.requests += 1
            entry.last = now
            entry.window.add(bucket, seconds, tokens)
        self.total.first = self.total.first or now

    def over_share(self, caller: str, now: float) -> bool:
        """Whether ``caller`` used more than ``max_share`` of this server's compute seconds in the window: the
        scheduler then serves it after the callers within their share (never refused: alone, it is served at once)."""
        if self.max_share >= 1:
            return False
        self._expire(now)
        usage = self.callers.get(caller)
        total = self.total.window.seconds
        return usage is not None and total > 0 and usage.window.seconds > self.max_share * total

    def info(self, now: float) -> dict:
        """The counts ``rpc_info`` shows: totals, the window, and the ``top`` heaviest callers by tokens."""
        self._expire(now)
        heaviest = sorted(self.callers.items(), key=lambda item: item[1].tokens, reverse=True)[:self.top]
        return {
            "max_share": self.max_share, "window_s": self.window, "callers_tracked": len(self.callers),
            "callers_forgotten": self.forgotten, "refused": self.refused,
            "total": {"tokens": self.total.tokens, "seconds": round(self.total.seconds, 6),
                      "requests": self.total.requests, "since": self.total.first or None},
            "in_window": {"tokens": self.total.window.tokens, "seconds": round(self.total.window.seconds, 6)},
            "callers": [{"peer_id": peer, "tokens": entry.tokens, "seconds": round(entry.seconds, 6),
                         "requests": entry.requests, "refused": entry.refused,
                         "window_tokens": entry.window.tokens, "window_seconds": round(entry.window.seconds, 6),
                         "first": entry.first, "last": entry.last}
                        for peer, entry in heaviest],
        }


def parse_usage(raw: Any, top: int = TOP_CALLERS) -> Optional[dict]:
    """A server's ``rpc_info["usage"]`` as a reader may show it (``swarm.health``, the auditor): bounded, every
    field checked (:mod:`swarm.utils.fields`), at most ``top`` callers; None for anything malformed. It is what the
    server says, not measured by the reader."""
    try:
        if not isinstance(raw, dict):
            raise ValueError("not a map")
        total, window, callers = raw["total"], raw["in_window"], raw["callers"]
        if not isinstance(total, dict) or not isinstance(window, dict) or not isinstance(callers, list):
            raise ValueError("malformed")
        return {
            "max_share": fields.number(raw["max_share"], 0.0, 1.0), "window_s": fields.number(raw["window_s"], 0, 1e6),
            "callers_tracked": fields.integer(raw["callers_tracked"]),
            "callers_forgotten": fields.integer(raw["callers_forgotten"]), "refused": fields.integer(raw["refused"]),
            "total": {"tokens": fields.integer(total["tokens"]), "seconds": fields.number(total["seconds"]),
                      "requests": fields.integer(total["requests"])},
            "in_window": {"tokens": fields.integer(window["tokens"]), "seconds": fields.number(window["seconds"])},
            "callers": [_caller(entry) for entry in callers[:top]],
        }
    except (KeyError, TypeError, ValueError):
        return None


def _caller(entry: Any) -> dict:
    if not isinstance(entry, dict):
        raise ValueError("a caller is a map")
    return {"peer_id": fields.text(entry["peer_id"], MAX_PEER_ID_CHARS), "tokens": fields.integer(entry["tokens"]),
            "seconds": fields.number(entry["seconds"]), "requests": fields.integer(entry["requests"]),
            "refused": fields.integer(entry["refused"]), "window_seconds": fields.number(entry["window_seconds"])}
