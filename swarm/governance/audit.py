"""An optional JSON-lines audit log: one record per generation (route, tier, spot checks, halts)."""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)


class AuditLog:
    """Appends one JSON object per line; safe to share between threads of one process."""

    def __init__(self, path: Optional[str | Path]):
        self.path = Path(path) if path else None
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = json.dumps({"time": time.time(), **record}, default=str, sort_keys=True)
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as file:
                file.write(line + "\n")
