"""When each test file ran on which pytest-xdist worker: the figures of docs/TESTING.md "Forked servers, the longest
files first" (a worker that starts a long file late ends long after the others).

    PYTHONPATH=benchmarks python -m pytest -q -n 3 --dist loadfile -p xdist_timeline   # records
    python benchmarks/xdist_timeline.py                                              # reports

As a pytest plugin (``-p xdist_timeline``) it appends each test's start and end, in seconds since the session began,
to ``$XDIST_TIMELINE_DIR/WORKER.tsv`` (default ``/tmp/xdist-timeline``, emptied at the start of a run). Run as a
script it prints, per worker, each file's span (those over ``--over`` seconds) and the worker's last end.
"""
from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

DIRECTORY = Path(os.environ.get("XDIST_TIMELINE_DIR", "/tmp/xdist-timeline"))
STARTED = time.time()


RECORDING: dict[str, object] = {"worker": None}  # this process's xdist worker id, or "main"; None: not recording


def pytest_configure(config) -> None:
    worker_input = getattr(config, "workerinput", None)  # set on xdist workers (not the environment: a pytest run
    if worker_input is not None:  # inside a worker inherits PYTEST_XDIST_WORKER)
        RECORDING["worker"] = worker_input["workerid"]
        return
    shutil.rmtree(DIRECTORY, ignore_errors=True)  # the controller starts the run; workers inherit its start time
    DIRECTORY.mkdir(parents=True)
    os.environ["XDIST_TIMELINE_T0"] = str(STARTED)
    if not getattr(config.option, "numprocesses", None):  # with workers, they record, not it
        RECORDING["worker"] = "main"


def _append(nodeid: str, event: str) -> None:
    if RECORDING["worker"] is None:
        return
    started = float(os.environ.get("XDIST_TIMELINE_T0", STARTED))
    with open(DIRECTORY / f"{RECORDING['worker']}.tsv", "a") as log:
        log.write(f"{time.time() - started:.1f}\t{event}\t{nodeid}\n")


def pytest_runtest_logstart(nodeid, location) -> None:
    _append(nodeid, "start")


def pytest_runtest_logfinish(nodeid, location) -> None:
    _append(nodeid, "end")


def report(directory: Path, over: float) -> str:
    lines = []
    for log in sorted(directory.glob("*.tsv")):
        spans: dict[str, list[float]] = {}
        for row in log.read_text().splitlines():
            seconds, _, nodeid = row.split("\t")
            span = spans.setdefault(nodeid.split("::")[0], [float(seconds), float(seconds)])
            span[1] = float(seconds)
        ends = [end for _, end in spans.values()]
        lines.append(f"{log.stem}: last test ended at {max(ends):.1f} s")
        lines += [f"  {start:6.1f}-{end:6.1f} s ({end - start:5.1f}) {name}"
                  for name, (start, end) in spans.items() if end - start >= over]
    return "\n".join(lines) or f"no timeline in {directory}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", nargs="?", type=Path, default=DIRECTORY, help="where the plugin wrote")
    parser.add_argument("--over", type=float, default=8.0, help="list files that took at least this many seconds")
    args = parser.parse_args()
    print(report(args.directory, args.over))


if __name__ == "__main__":
    main()
