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


_chosen: Optional[int] = None  # the count this process set through apply_threads, if any


def apply_threads(threads: Optional[int]) -> int:
    """Set torch's CPU threads to ``threads`` (default :func:`default_threads`) and return the number set."""
    import torch  # here, not at import: a command's --help must not wait for torch

    global _chosen
    count = threads or default_threads()
    torch.set_num_threads(count)
    _chosen = count
    return count


def use_threads(threads: Optional[int] = None) -> int:
    """The front ends' choice (``from_pretrained(threads=...)``): ``threads`` if given; else the count this
    process already chose (a command's ``--threads``, an earlier model), else :func:`default_threads`."""
    import torch

    if threads is None and _chosen is not None:
        return torch.get_num_threads()
    count = apply_threads(threads)
    logger.info("torch CPU threads: %d (from_pretrained(threads=...) or $OMP_NUM_THREADS to change)", count)
    return count
