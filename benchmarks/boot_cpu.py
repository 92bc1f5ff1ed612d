"""Wall time and CPU seconds of one ``python -m swarm.server`` start, until it says SERVER READY: exec'd, and forked
from a process that preloaded torch and hivemind (``LocalSwarm(fork_server=True)``, as the tests start servers), side
by side.

    python benchmarks/boot_cpu.py [--boots 4]

On 127.0.0.1 beside a bootstrap peer: a server of the tiny test model's four blocks (``--compute-threads 1``, as the
tests start them) is started, waited for, measured (its CPU and that of every process under it: the DHT process and
the p2pd daemon) and SIGKILLed, ``--boots`` times per way. The fork server's own import, paid once per LocalSwarm, is
printed apart. Most of the test suite's CPU is such starts (docs/TESTING.md, "Speed and load").
"""
from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, when run as a script

from swarm.testing.checkpoints import make_checkpoint, tiny_config  # noqa: E402
from swarm.utils.local_swarm import LocalSwarm  # noqa: E402


def family_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and of every process under it now."""
    total = 0.0
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            total += sum(process.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def boots_of(path: Path, boots: int, fork_server: bool) -> tuple[float, float]:
    """Mean wall and CPU seconds of ``boots`` server starts, exec'd or forked."""
    way = "forked" if fork_server else "exec'd"
    with LocalSwarm(env={"OMP_NUM_THREADS": "1"}, fork_server=fork_server) as swarm:
        swarm.start_bootstrap()
        walls, cpus = [], []
        for _ in range(boots):
            started = time.monotonic()
            server = swarm.start_server(str(path), "0:4", "--compute-threads", "1")
            walls.append(time.monotonic() - started)
            cpus.append(family_cpu(server.process.pid))
            swarm.terminate(server, signal.SIGKILL)
            print(f"{way} server start: {walls[-1]:.2f} s wall, {cpus[-1]:.2f} CPU s", flush=True)
        if fork_server:
            print(f"the fork server's own start (once per LocalSwarm): {family_cpu(swarm.fork_server_pid):.2f} "
                  "CPU s", flush=True)
    return sum(walls) / boots, sum(cpus) / boots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--boots", type=int, default=4, help="server starts per way (exec'd, forked)")
    boots = parser.parse_args().boots
    with tempfile.TemporaryDirectory() as directory:
        path = make_checkpoint(Path(directory), tiny_config())
        (exec_wall, exec_cpu), (fork_wall, fork_cpu) = (boots_of(path, boots, fork) for fork in (False, True))
    print(f"mean of {boots}: exec'd {exec_wall:.2f} s wall, {exec_cpu:.2f} CPU s; forked {fork_wall:.2f} s wall, "
          f"{fork_cpu:.2f} CPU s; forked/exec'd: {fork_wall / exec_wall:.2f}x wall, {fork_cpu / exec_cpu:.2f}x CPU")


if __name__ == "__main__":
    main()
