"""Where a request's predictions were computed: on a head server, or by the client's own head, and why.

At LLaDA-8B's widths the client's head is 1 GB and a second per step on a CPU; a user who sees the client load
it should learn what made it necessary (``info["head"]``, and one log line per reason).
"""
from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)


class HeadUse:
    """Counts one request's denoiser calls by where their head ran; shared by the calls' threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logged: set[str] = set()  # reasons already logged by this client
        self.server_calls = 0
        self.client_calls: dict[str, int] = {}

    def reset(self) -> None:
        """Start counting a new request."""
        with self._lock:
            self.server_calls, self.client_calls = 0, {}

    def record(self, on_server: bool, why: str) -> None:
        """One call: answered by a head server, or scored by the client's head because of ``why``."""
        with self._lock:
            if on_server:
                self.server_calls += 1
                return
            self.client_calls[why] = self.client_calls.get(why, 0) + 1
            first = why not in self._logged
            self._logged.add(why)
        if first:
            logger.info("the client computes the output head itself: %s", why)

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"server_calls": self.server_calls, "client_calls": sum(self.client_calls.values()),
                    "client_reasons": sorted(self.client_calls)}
