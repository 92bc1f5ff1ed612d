"""Keeping what a long-lived process loaded once out of Python's cyclic garbage collector.

A full collection walks every tracked object. After ``import torch, hivemind`` that is some hundreds of thousands of
module-level objects that live as long as the process, and a server, a DHT process or a fork server's children walk
them again at every full collection for nothing: perf put the collector at about a tenth of the test suite's Python
CPU. :func:`freeze_loaded` collects what is already garbage, then moves every surviving object to the permanent
generation (``gc.freeze``), which collections skip; a process forked afterwards (hivemind's DHT process, a fork
server's child) inherits that. Only for a process whose code, not a user's, owns what has been loaded so far: an
object frozen here and dropped later is never freed by the collector if it sits in a reference cycle.
"""
from __future__ import annotations

import gc


def freeze_loaded() -> None:
    """Free the garbage there is now, then exempt every object alive now from later collections."""
    gc.collect()
    gc.freeze()
