"""What each tier cost, printed at the end of every run (docs/TESTING.md "Budgets"), so that the figures there are
CI's own: the tests run per tier, their summed time and CPU seconds, and the peak resident memory of the pytest
process (each xdist worker's) during any one of them.

The peak is the kernel's high-water mark (``VmHWM``), reset before each test by writing 5 to
``/proc/self/clear_refs`` (Linux; elsewhere the peak is the process's so far): a test's own peak, its fixtures
included, not the session's. It counts this process only: the servers a swarm test starts are other processes.
CPU seconds are this process's and its reaped children's (``getrusage``): on shared cores the wall time moves with
the load, the CPU time much less.

With ``TEST_COSTS=FILE`` in the environment, each test's line (node id, tier, wall s, CPU s, peak MB) is also
written to FILE, for ``python benchmarks/test_costs.py --file FILE`` to rank. With ``CPU_OF_RUNNING=DIR`` (set by
``benchmarks/cpu_of.py --by-file``), each process that runs tests writes the node id it is running to ``DIR/PID``, so
that the CPU of the servers, peers and daemons it starts can be charged to the test file that started them.
"""
from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")
COSTS = "tier_costs"  # the user property that carries a test's (CPU s, peak MB) from a worker to the controller
# A `-m unit` run's budget on 2 cores (issue 56): wall seconds from start to end, and the process's peak in GB.
# docs/TESTING.md states the same figures (tests/test_tiers.py checks they agree).
BUDGETS = {"unit": (60.0, 2.0)}


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def peak_mb() -> float:
    for line in STATUS.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def reset_peak() -> None:
    try:
        CLEAR_REFS.write_text("5")
    except OSError:  # not Linux, or not allowed: the figure is the process's peak so far
        pass


@dataclass
class TierCost:
    tests: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    peak_mb: float = 0.0


class TierCosts:
    """The plugin: measures in the process that runs a test, adds up in the one that reports (xdist's controller)."""

    def __init__(self, tiers: tuple[str, ...], worker: bool) -> None:
        self.tiers = tiers
        self.costs: dict[str, TierCost] = {}
        self.running: dict[str, float] = {}
        self.durations: dict[str, float] = {}
        self.record = None if worker else os.environ.get("TEST_COSTS")  # the controller writes, not each worker

    def tier(self, keywords) -> str:
        return next((tier for tier in self.tiers if tier in keywords), "none")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item) -> None:
        reset_peak()
        running = os.environ.get("CPU_OF_RUNNING")
        if running:
            Path(running, str(os.getpid())).write_text(item.nodeid)
        self.running[item.nodeid] = cpu_seconds()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if call.when == "teardown":
            spent = cpu_seconds() - self.running.pop(item.nodeid, cpu_seconds())
            report.user_properties.append((COSTS, (round(spent, 3), round(peak_mb(), 1))))
        return report

    def pytest_runtest_logreport(self, report) -> None:
        cost = self.costs.setdefault(self.tier(report.keywords), TierCost())
        cost.seconds += report.duration
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
        if report.when == "call" or (report.when == "setup" and not report.passed):
            cost.tests += 1
        measured = dict(report.user_properties).get(COSTS)
        if report.when == "teardown" and measured:
            cpu, peak = measured
            wall = self.durations.pop(report.nodeid, 0.0)
            cost.cpu_seconds += cpu
            cost.peak_mb = max(cost.peak_mb, peak)
            if self.record:
                with open(self.record, "a") as out:
                    out.write(f"{report.nodeid}\t{self.tier(report.keywords)}\t{wall:.2f}\t{cpu:.2f}\t"
                              f"{peak:.0f}\n")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.costs:
            return
        wall = time.time() - psutil.Process().create_time()  # from the process's start: imports count too
        write = terminalreporter.write_line
        terminalreporter.section("tier costs (docs/TESTING.md \"Budgets\")")
        for tier in (*self.tiers, "none"):
            cost = self.costs.get(tier)
            if cost and cost.tests:
                write(f"{tier}: {cost.tests} tests, {cost.seconds:.1f} s of test time, {cost.cpu_seconds:.1f} CPU s, "
                      f"peak {cost.peak_mb / 1024:.2f} GB (one pytest process)")
        ran = [tier for tier, cost in self.costs.items() if cost.tests]
        write(f"session: {wall:.1f} s wall and {cpu_seconds():.1f} CPU s of this process since it started "
              f"(imports and collection included), load average {os.getloadavg()[0]:.1f} at the end")
        if len(ran) == 1 and ran[0] in BUDGETS:  # a run of one tier alone: its budget applies
            seconds, gigabytes = BUDGETS[ran[0]]
            peak = self.costs[ran[0]].peak_mb / 1024
            met = wall <= seconds and peak <= gigabytes
            write(f"{ran[0]} budget: {seconds:.0f} s and {gigabytes:.0f} GB on 2 quiet cores; this run {wall:.1f} s, "
                  f"{peak:.2f} GB: {'within' if met else 'OVER (docs/TESTING.md: a loaded machine takes longer)'}")
