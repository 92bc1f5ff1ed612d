"""The wall time and CPU seconds of a command and of every process under it, SIGKILLed servers' daemons included.

    python benchmarks/cpu_of.py python -m pytest -q tests/test_head.py

``/usr/bin/time`` counts only the children a process waited for: when a test SIGKILLs a server, the server's DHT
process and p2pd daemons are orphaned and reaped by init, and their CPU is lost to the figure. Here this process is a
child subreaper (Linux): orphans below it are handed to it, it reaps them, and their CPU is counted. After the command
exits, leftovers get 30 s to exit before the figure is printed (to stderr, after the command's own output).
"""
from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main() -> int:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit(f"cannot become a child subreaper: {os.strerror(ctypes.get_errno())}")
    started = time.monotonic()
    command = subprocess.Popen(sys.argv[1:])
    code, deadline = None, None
    while True:
        try:
            pid, status = os.waitpid(-1, 0 if deadline is None else os.WNOHANG)
        except ChildProcessError:
            break  # nothing left under us
        if pid == command.pid:
            code, deadline = os.waitstatus_to_exitcode(status), time.monotonic() + 30
            wall = time.monotonic() - started
        elif pid == 0:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"cpu_of: {wall:.1f} s wall, {usage.ru_utime:.1f} s user, {usage.ru_stime:.1f} s sys, "
          f"{usage.ru_utime + usage.ru_stime:.1f} CPU s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
