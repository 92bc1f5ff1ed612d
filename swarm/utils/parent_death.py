"""Dying with the parent: a child process that must not outlive the process that started it.

Linux's ``PR_SET_PDEATHSIG`` has the kernel signal a process when the *thread* that forked it exits, whatever the
way (``kill -9`` included). The DHT peers' processes (:mod:`swarm.dht.node`) and the fork server's children
(:mod:`swarm.utils.forkserver`) use it; elsewhere it is unavailable and they fall back or do without.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Linux: have the kernel send ``sig`` to this process when the thread that started it exits."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent(parent_pid: int) -> bool:
    """In a child just forked by ``parent_pid`` (from its only or main thread): be SIGKILLed when it exits, and exit
    at once if it already has (it could die between the fork and the ``prctl``, which then never fires). False where
    the kernel cannot do it (not Linux): the caller watches on its own, or does without."""
    if not set_parent_death_signal(signal.SIGKILL):
        return False
    if os.getppid() != parent_pid:
        os._exit(0)
    return True
