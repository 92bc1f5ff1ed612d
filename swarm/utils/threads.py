"""torch's CPU threads, chosen the same way by every command and by the Python API.

torch's own default takes every core; two such pools on one machine (a client beside its servers, two servers)
spin against each other: on 2 busy cores a generation took 65 s with 2 threads, 3.4 s with 1
(docs/OPERATIONS.md, "Threads").
"""
from __future__ import annotations

import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)

THREADS_HELP = ("torch CPU threads for this process's compute. Default: $OMP_NUM_THREADS if set, else half of the "
                "CPUs it may use (at least 1), which leaves room for the swarm's other processes.")


def default_threads() -> int:
    """Half the CPUs this process may use, at least 1; ``$OMP_NUM_THREADS`` wins."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // 2)


def apply_threads(threads: Optional[int]) -> int:
    """Set torch's CPU threads to ``threads`` (default :func:`default_threads`) and return the number set."""
    import torch  # here, not at import: a command's --help must not wait for torch

    count = threads or default_threads()
    torch.set_num_threads(count)
    return count
