"""One progress line on a terminal, plain lines elsewhere (a log file, a pipe, CI).

On a terminal the line is redrawn in place with ``\\r``; it is cut to the terminal's width, since a line longer
than the terminal wraps and every redraw would then leave a new line behind. Elsewhere ``\\r`` would only garble
the log, so updates are lines of their own: every ``plain_every``-th one, and the last when the line is closed (a
log of a 256-step run holds a few lines, not 256).
"""
from __future__ import annotations

import shutil
import sys
from typing import Optional, TextIO

ELLIPSIS = "..."


def fit(text: str, width: int) -> str:
    """``text`` on one line of at most ``width`` characters (the end cut and marked with an ellipsis)."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    return text[:max(0, width - len(ELLIPSIS))] + ELLIPSIS if width > len(ELLIPSIS) else text[:width]


class StepLine:
    """Shows the latest of a series of status texts (``show``) on ``stream`` (stderr by default)."""

    def __init__(self, enabled: bool = True, stream: Optional[TextIO] = None, plain_width: int = 200,
                 plain_every: int = 1):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.plain_width = plain_width
        self.plain_every = max(1, plain_every)
        self._drawn = False
        self._shown = 0  # updates so far
        self._unwritten: Optional[str] = None  # off a terminal: the latest update not written yet

    def width(self) -> int:
        """Columns available on the terminal, leaving the last one free (writing into it wraps on some
        terminals)."""
        return max(10, shutil.get_terminal_size(fallback=(80, 24)).columns - 1)

    def show(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            width = self.width()
            self.stream.write("\r" + fit(text, width).ljust(width))
            self._drawn = True
        else:
            self._shown += 1
            self._unwritten = text
            if (self._shown - 1) % self.plain_every:
                return
            self._write_plain()
        self.stream.flush()

    def _write_plain(self) -> None:
        self.stream.write(fit(self._unwritten, self.plain_width) + "\n")
        self._unwritten = None

    def close(self) -> None:
        """End the redrawn line; off a terminal, write the last update if it was skipped."""
        if self._unwritten is not None:
            self._write_plain()
            self.stream.flush()
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
