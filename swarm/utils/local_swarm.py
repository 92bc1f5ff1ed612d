"""Starting a bootstrap peer and servers as subprocesses on 127.0.0.1 (examples, tests, benchmarks).

Every process started here is stopped by :meth:`LocalSwarm.stop` (also on errors, via ``with``). With
``fork_server=True`` each Python process is forked from one that has already imported torch and hivemind
(``swarm.utils.forkserver``): about 1 CPU s less per server, for callers that start many.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, TextIO, Union

import psutil

from swarm.utils.forkserver import DEFAULT_PRELOAD, ForkedProcess, ForkServer, forkable

logger = logging.getLogger(__name__)

READY_PATTERN = re.compile(r"(?:DHT|SERVER) READY peer_id=(\S+)(?: blocks=(\d+):(\d+))? maddrs=(\S+)")


@dataclass
class ManagedProcess:
    name: str
    process: Union[subprocess.Popen, ForkedProcess]
    peer_id: str = ""
    maddrs: list[str] = field(default_factory=list)
    span: Optional[tuple[int, int]] = None
    args: list[str] = field(default_factory=list)  # what followed ``python`` (for :meth:`LocalSwarm.restart`)
    env: dict[str, str] = field(default_factory=dict)  # its own variables over the swarm's environment (the same)
    lines: "queue.Queue[str]" = field(default_factory=queue.Queue)
    log: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


class LocalSwarm:
    """``with LocalSwarm() as swarm: swarm.start_bootstrap(); swarm.start_server("default", "0:8")``.

    ``fork_server``: start ``-m MODULE`` and script processes by forking a process that preloaded torch and hivemind
    (see ``swarm.utils.forkserver``) instead of exec'ing ``python`` for each; what they run is the same. ``preload``:
    the modules it imports first, for callers whose processes all import more (say ``torch._dynamo``, which every
    torch optimizer imports when it is made: 1.2 CPU s a process).
    """

    def __init__(
        self, python: str = sys.executable, env: Optional[dict[str, str]] = None, startup_timeout: float = 120,
        fork_server: bool = False, shared_forks: Optional[ForkServer] = None,
        preload: Sequence[str] = DEFAULT_PRELOAD,
    ):
        self.python = python
        self.env = swarm_env(env)
        self.startup_timeout = startup_timeout
        self.processes: list[ManagedProcess] = []
        self.bootstrap: Optional[ManagedProcess] = None
        # ``shared_forks``: a fork server that other swarms use too (started with :func:`swarm_env`); its owner
        # closes it, :meth:`stop` leaves it running
        self.fork_server, self.preload = fork_server or shared_forks is not None, tuple(preload)
        self._shared_forks = shared_forks
        self._forks: Optional[ForkServer] = shared_forks or (self._new_fork_server() if fork_server else None)

    def _new_fork_server(self) -> ForkServer:
        return ForkServer(self.python, self.env, preload=self.preload, startup_timeout=self.startup_timeout)

    @property
    def fork_server_pid(self) -> Optional[int]:
        """The fork server's process id while it runs (``fork_server=True``), for measuring it."""
        return self._forks.process.pid if self._forks is not None else None

    @property
    def forks(self) -> Optional[ForkServer]:
        """The fork server this swarm's processes fork from (None where they are exec'd): another swarm's
        ``shared_forks``, where it needs a bootstrap peer of its own but not a fork server (1.5 CPU s to start)."""
        return self._forks

    @property
    def initial_peers(self) -> list[str]:
        return list(self.bootstrap.maddrs) if self.bootstrap else []

    def start_bootstrap(self) -> ManagedProcess:
        self.bootstrap = self._start("bootstrap", ["-m", "swarm.dht"])
        return self.bootstrap

    def start_server(self, model: str, blocks: Optional[str] = None, *extra: str, name: Optional[str] = None,
                     wait: bool = True, entry: Sequence[str] = ("-m", "swarm.server")) -> ManagedProcess:
        """Start ``python -m swarm.server`` (or another ``entry`` taking the same flags, such as a test's
        modified server); with ``wait=False`` call :meth:`wait_ready` later (parallel start)."""
        # announcing at the servers' default period (15 s): at LocalSwarm's former 5, an idle bootstrap peer and three
        # servers spent 1.54 CPU s a minute, 0.43 at 30 (each announcement is signed stores through every daemon)
        args = [*entry, "--model", str(model), "--throughput", "1000"]
        if blocks:
            args += ["--blocks", blocks]
        for peer in self.initial_peers:
            args += ["--initial-peers", peer]
        return self._start(name or f"server-{blocks}", args + list(extra), wait)

    def start_command(self, name: str, args: Sequence[str], log: Optional[Path] = None,
                      env: Optional[dict[str, str]] = None) -> ManagedProcess:
        """Start ``python *args`` (say ``["-m", "swarm.improve", ...]``), forked where this swarm has a fork server,
        without waiting for a READY line; with ``log`` its output also goes to that file as it comes. ``env``: its
        own variables over this swarm's environment (``SWARM_GOVERNANCE_KEYS``, say)."""
        return self._start(name, args, wait=False, log=log, env=env)

    def _start(self, name: str, args: Sequence[str], wait: bool = True, log: Optional[Path] = None,
               env: Optional[dict[str, str]] = None) -> ManagedProcess:
        process = self._launch(name, args, dict(self.env, **(env or {})))
        managed = ManagedProcess(name, process, args=list(args), env=dict(env or {}))
        self.processes.append(managed)
        copy = open(log, "w") if log is not None else None  # noqa: SIM115 (the pump closes it at the output's end)
        threading.Thread(target=self._pump, args=(managed, copy), daemon=True).start()
        if wait:
            self.wait_ready(managed)
        return managed

    def run_command(self, args: Sequence[str], env: Optional[dict[str, str]] = None, cwd: Optional[str] = None,
                    timeout: float = 600) -> tuple[int, str]:
        """Run ``python *args`` to its end, as a user's terminal runs a command that uses the swarm (forked where this
        swarm has a fork server), in ``env`` (default: the swarm's) and ``cwd``: its exit code and its stdout and
        stderr together. Killed (with its session) after ``timeout`` seconds."""
        process = self._launch(" ".join(args[:2]), args, dict(self.env if env is None else env), cwd)
        timer = threading.Timer(timeout, signal_family, (process.pid, [], signal.SIGKILL))
        timer.start()
        try:
            output = process.stdout.read()
            return process.wait(), output
        finally:
            timer.cancel()

    def _launch(self, name: str, args: Sequence[str], env: dict[str, str],
                cwd: Optional[str] = None) -> Union[subprocess.Popen, ForkedProcess]:
        """Start ``python *args`` with the environment ``env`` (whole: a test may have set a variable since the fork
        server started), in a session of its own, stdout and stderr on one pipe: forked where this swarm has a fork
        server, else exec'd."""
        command = [self.python, *args]
        if self.fork_server and forkable(args):
            if self._forks is None:
                self._forks = self._new_fork_server()
            logger.info("starting %s (forked): %s", name, " ".join(command))
            return self._fork(args, env, cwd)
        logger.info("starting %s: %s", name, " ".join(command))
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=cwd, start_new_session=True)

    def _fork(self, args: Sequence[str], env: dict[str, str], cwd: Optional[str] = None) -> ForkedProcess:
        return self._forks.start(args, env=env, cwd=cwd)

    def restart(self, managed: ManagedProcess) -> ManagedProcess:
        """Start ``managed``'s command again (stopping it first if it still runs) and wait for its READY line; it
        takes ``managed``'s place. With ``--identity-path`` among its arguments it has the same peer id again, so a
        test that stopped a shared server can put the swarm back as later tests expect it."""
        if managed.alive:
            self.terminate(managed)
        restarted = self._start(managed.name, managed.args, wait=False, env=managed.env)
        self.processes.remove(managed)
        if managed is self.bootstrap:
            self.bootstrap = restarted
        self.wait_ready(restarted)
        return restarted

    @staticmethod
    def _pump(managed: ManagedProcess, copy: Optional[TextIO] = None) -> None:
        with copy or contextlib.nullcontext():
            for line in managed.process.stdout:
                managed.log.append(line.rstrip())
                managed.lines.put(line)
                if copy is not None:
                    copy.write(line)
                    copy.flush()

    def wait_ready(self, managed: ManagedProcess) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            try:
                line = managed.lines.get(timeout=0.5)
            except queue.Empty:
                if not managed.alive:
                    break
                continue
            match = READY_PATTERN.search(line)
            if match:
                managed.peer_id = match.group(1)
                if match.group(2):
                    managed.span = (int(match.group(2)), int(match.group(3)))
                managed.maddrs = match.group(4).split(",")
                return
        tail = "\n".join(managed.log[-30:])
        self.stop()
        raise RuntimeError(f"{managed.name} did not become ready:\n{tail}")

    def terminate(self, managed: ManagedProcess, sig: int = signal.SIGTERM, timeout: float = 30) -> Optional[int]:
        """Stop a process: SIGKILL takes it and every process below it at once (a crash); other signals go to the
        main process, which shuts its DHT and daemon down itself. Leftovers are killed. Returns the exit code."""
        family = descendants(managed.process.pid)
        try:
            if sig == signal.SIGKILL:
                signal_family(managed.process.pid, family, signal.SIGKILL)
            elif managed.alive:
                managed.process.send_signal(sig)
            code = managed.process.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        except ProcessLookupError:
            code = managed.process.poll()
        signal_family(managed.process.pid, family, signal.SIGKILL)  # the DHT child and daemons, if anything is left
        managed.process.wait(10)
        return code

    def signal(self, managed: ManagedProcess, sig: int) -> None:
        """``sig`` to a process and every process below it (SIGSTOP: the peer and its daemons stop answering)."""
        signal_family(managed.process.pid, descendants(managed.process.pid), sig)

    def stop(self) -> None:
        """Stop every process: all but the bootstrap peer at once (a server takes 1-3 s to announce that it leaves,
        through the bootstrap peer), then the bootstrap peer."""
        leaving = [managed for managed in reversed(self.processes) if managed is not self.bootstrap and managed.alive]
        if leaving:
            with ThreadPoolExecutor(len(leaving)) as pool:
                for stopped in [pool.submit(self.terminate, managed, signal.SIGTERM, 15) for managed in leaving]:
                    stopped.result()
        if self.bootstrap is not None and self.bootstrap.alive:
            self.terminate(self.bootstrap, signal.SIGTERM, timeout=15)
        self.processes.clear()
        if self._forks is not None and self._forks is not self._shared_forks:
            self._forks.close()
            self._forks = None

    def __enter__(self) -> "LocalSwarm":
        self._previous_sigterm = None
        if threading.current_thread() is threading.main_thread():  # a benchmark stopped with SIGTERM (kill, a
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # timeout) stops its servers
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)


def swarm_env(env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment of a local swarm's processes: this one's with ``env`` over it, never joining a public swarm."""
    made = dict(os.environ, **(env or {}))
    made.pop("SWARM_INITIAL_PEERS", None)  # a local swarm never joins a public one by accident
    made["SWARM_BOOTSTRAP_FILE"] = os.devnull
    return made


def descendants(pid: int) -> list[psutil.Process]:
    """The processes below ``pid`` (its DHT process, their libp2p daemons), while they run."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def signal_family(group: int, family: list[psutil.Process], sig: int) -> None:
    """``sig`` to the process group ``group`` and to each of ``family``. A p2pd has a group of its own (a terminal's
    Ctrl-C must not reach it, ``swarm.dht.node``): a crash or a hang of a peer must reach it at the same moment,
    not when its parent's death signal does."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)
    for process in family:
        with contextlib.suppress(psutil.Error):
            process.send_signal(sig)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """Turn SIGTERM into SystemExit, so that ``with LocalSwarm()`` blocks unwind and terminate their processes."""
    raise SystemExit(128 + signum)
