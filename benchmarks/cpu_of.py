"""The wall time and CPU seconds of a command and of every process under it, SIGKILLed servers' daemons included.

    python benchmarks/cpu_of.py python -m pytest -q tests/test_head.py
    python benchmarks/cpu_of.py --by-kind python -m pytest -q -n 3 --dist loadfile

``--by-kind`` also samples every process under the command twice a second and prints CPU seconds per kind of
process (libp2p daemons, ``python -m MODULE`` by module, scripts by name; a forked process counts with its parent's
command, as a server's DHT process does): the last half second of each process is missed, so the kinds' sum is a
little under the total.

``--by-file`` charges every process's CPU, sampled the same way, to the test file that its pytest process (an xdist
worker, or pytest itself) was running when it was spent: the tests' plugin (``tests/tier_costs.py``) writes each
worker's running test to a folder this sets in ``CPU_OF_RUNNING``. A server a module fixture started counts for that
file; the session's shared swarm counts for the files running while it spends. It prints the files by CPU seconds,
with the libp2p daemons and the python processes each started.

``/usr/bin/time`` counts only the children a process waited for: when a test SIGKILLs a server, the server's DHT
process and p2pd daemons are orphaned and reaped by init, and their CPU is lost to the figure. Here this process is a
child subreaper (Linux): orphans below it are handed to it, it reaps them, and their CPU is counted. After the command
exits, leftovers get 30 s to exit before the figure is printed (to stderr, after the command's own output).
"""
from __future__ import annotations

import collections
import ctypes
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

PR_SET_CHILD_SUBREAPER = 36


def kind_of(command: list[str]) -> str:
    """What a process is, from its command line."""
    text = " ".join(command)
    if "p2pd" in text:
        return "libp2p daemon (p2pd)"
    if "-m" in command[:-1]:
        module = command[command.index("-m") + 1]
        if module == "swarm.utils.forkserver":  # LocalSwarm(fork_server=True): its children keep its command line
            return "python -m swarm.utils.forkserver (the servers, peers and test servers forked from it)"
        return f"python -m {module}"
    if "-c" in command[:-1]:
        return "python -c (pytest-xdist workers, spawned helpers)"
    scripts = [part for part in command[1:] if part.endswith(".py")]
    return os.path.basename(scripts[0] if scripts else command[0]) if command else "?"


class KindSampler(threading.Thread):
    """Every process under this one, sampled: pid -> (kind, CPU seconds so far)."""

    def __init__(self, every: float = 0.5):
        super().__init__(daemon=True)
        self.every, self.seen, self.done = every, {}, threading.Event()

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self.done.is_set():
            for process in me.children(recursive=True):
                try:
                    times = process.cpu_times()
                    key = (process.pid, process.create_time())
                    self.seen[key] = (kind_of(process.cmdline()), times.user + times.system)
                except psutil.Error:
                    pass
            self.done.wait(self.every)

    def report(self) -> str:
        cpu, count = collections.Counter(), collections.Counter()
        for kind, seconds in self.seen.values():
            cpu[kind] += seconds
            count[kind] += 1
        lines = [f"{seconds:8.1f} CPU s  {count[kind]:5d} processes  {kind}" for kind, seconds in cpu.most_common()]
        return "\n".join([*lines, f"{sum(cpu.values()):8.1f} CPU s sampled"])


class FileSampler(KindSampler):
    """Every process under this one, its CPU charged to the test file its pytest process runs (``--by-file``)."""

    def __init__(self, running: str, every: float = 0.5):
        super().__init__(every)
        self.running = Path(running)
        self.owner: dict[int, int] = {}  # pid -> the pid of the pytest process it belongs to (kept after orphaning)
        self.spent: dict[tuple[int, float], float] = {}
        self.cpu: collections.Counter = collections.Counter()
        self.tests: collections.Counter = collections.Counter()
        self.started: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def owner_of(self, process) -> Optional[int]:
        if process.pid not in self.owner:
            for candidate in [process, *process.parents()]:
                if (self.running / str(candidate.pid)).exists() or candidate.pid in self.owner:
                    self.owner[process.pid] = self.owner.get(candidate.pid, candidate.pid)
                    break
        return self.owner.get(process.pid)

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self.done.is_set():
            for process in me.children(recursive=True):
                try:
                    key, times = (process.pid, process.create_time()), process.cpu_times()
                    owner = self.owner_of(process)
                    if owner is None:
                        continue
                    test = (self.running / str(owner)).read_text()
                    where = test.split("::")[0] or "?"
                    now = times.user + times.system
                    if key not in self.spent and owner != process.pid:
                        kind = kind_of(process.cmdline())
                        self.started[where]["p2pd" if "p2pd" in kind else "python"] += 1
                    self.cpu[where] += now - self.spent.get(key, 0.0)
                    self.tests[test] += now - self.spent.get(key, 0.0)
                    self.spent[key] = now
                except (psutil.Error, OSError):
                    pass
            self.done.wait(self.every)

    def report(self) -> str:
        lines = [f"{seconds:8.1f} CPU s  {self.started[where]['p2pd']:4d} p2pd  {self.started[where]['python']:4d} "
                 f"python  {where}" for where, seconds in self.cpu.most_common()]
        tests = [f"{seconds:8.1f} CPU s  {test}" for test, seconds in self.tests.most_common(40)]
        return "\n".join([*lines, f"{sum(self.cpu.values()):8.1f} CPU s sampled", "the costliest tests (their module's "
                          "fixtures count for the test that set them up or tore them down):", *tests])


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in ("--by-kind", "--by-file") else None
    if mode:
        del sys.argv[1]
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sampler: Optional[KindSampler] = None
    if mode == "--by-kind":
        sampler = KindSampler()
    elif mode == "--by-file":
        os.environ["CPU_OF_RUNNING"] = tempfile.mkdtemp(prefix="cpu-of-")
        sampler = FileSampler(os.environ["CPU_OF_RUNNING"])
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit(f"cannot become a child subreaper: {os.strerror(ctypes.get_errno())}")
    started = time.monotonic()
    try:
        command = subprocess.Popen(sys.argv[1:])
    except OSError as error:
        sys.exit(f"cpu_of: cannot run {sys.argv[1]!r}: {error.strerror or error}")
    if sampler is not None:
        sampler.start()
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
    if sampler is not None:
        sampler.done.set()
        sampler.join()
        print(sampler.report(), file=sys.stderr)
    print(f"cpu_of: {wall:.1f} s wall, {usage.ru_utime:.1f} s user, {usage.ru_stime:.1f} s sys, "
          f"{usage.ru_utime + usage.ru_stime:.1f} CPU s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
