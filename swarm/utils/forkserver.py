"""Starting ``python -m MODULE ...`` and ``python SCRIPT ...`` by forking one that imported torch and hivemind.

A server spends most of its boot importing (``python -X importtime -c "import swarm.server.server"``: about 1 s, of
which torch is 0.75 s). A test suite or a demonstration that starts a hundred servers on two cores spends minutes of
CPU on that alone. A :class:`ForkServer` imports the ``preload`` modules once; :meth:`ForkServer.start` forks it, and
the child runs the command as the interpreter would have: in a session of its own (``os.killpg(pid, ...)`` reaches
it, as with ``Popen(start_new_session=True)``), stdout and stderr on a pipe the caller reads, stdin on /dev/null (or a
pipe the caller writes, ``start(..., stdin=True)``), the
caller's working directory, and ``sys.argv``, ``sys.path[0]``, ``__main__`` and the exit code as Python sets them.
The fork server is started with the environment its children get (``LocalSwarm.env``), so what the preloaded
modules read from the environment at import time is what an exec'd process would read; a start may give the child's
``os.environ`` as it is by then (``LocalSwarm`` does: a test may export a variable after its fork server started).
A start may also name a network namespace that the child enters first (the NAT lab's machines).

Preloading torch and hivemind (``DEFAULT_PRELOAD``) halves a server's start (``python benchmarks/boot_cpu.py``).
Neither starts a thread at import, but hivemind creates process-shared locks then (``multiprocessing.Lock`` in
``MPFuture``, ``SharedBytes`` and its context executor) that every forked child would share, so that one child
killed while holding one would stall its siblings; each child therefore makes its own (:func:`_fresh_module_state`),
as a fresh interpreter would, and so does numpy's global random generator.

The children are the fork server's, not the caller's: it reaps them and sends each exit status back, and
:class:`ForkedProcess` offers the part of ``subprocess.Popen`` that ``LocalSwarm`` and its callers use. They live no
longer than the fork server, and it no longer than its caller: it exits when its channel closes (the caller closed
it, or died however it died), and each child is SIGKILLed by the kernel when the fork server exits (Linux's parent
death signal), so a caller killed without its teardown leaves no server running for hours; a DHT process and
``p2pd`` below a child follow it (:mod:`swarm.dht.node`). ``ps`` shows
a child under the fork server's command line. Messages are JSON over a ``SOCK_SEQPACKET`` socket pair (one message
per packet); a start request carries the write end of the child's output pipe (and the read end of its input pipe,
if any) as ``SCM_RIGHTS`` descriptors.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import logging
import os
import queue
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, Any, Optional, Sequence

from swarm.utils.collector import freeze_loaded
from swarm.utils.parent_death import die_with_parent

logger = logging.getLogger(__name__)

DEFAULT_PRELOAD = ("torch", "hivemind")
# ... and for processes that make a torch optimizer (trainers, finetune peers): its first construction imports
# torch._dynamo, 1.2-1.4 CPU s a process
TRAINING_PRELOAD = (*DEFAULT_PRELOAD, "torch._dynamo")
MAX_MESSAGE_BYTES = 1 << 20  # a command line and its working directory; far more than any start needs
REAP_EVERY_S = 0.05  # how often the fork server looks for exited children between requests
CLONE_NEWNET = 0x40000000  # setns(2)'s namespace type: a network namespace (Python 3.12's os.CLONE_NEWNET)


def forkable(args: Sequence[str]) -> bool:
    """Whether ``python *args`` is a form a fork server runs: ``-m MODULE ...`` or ``SCRIPT.py ...``."""
    if not args:
        return False
    return (args[0] == "-m" and len(args) > 1) or not args[0].startswith("-")


class ForkedProcess:
    """A child of a :class:`ForkServer`, seen through the ``subprocess.Popen`` interface LocalSwarm uses."""

    def __init__(self, pid: int, args: list[str], stdout: Optional[IO[str]]):
        self.pid, self.args, self.stdout = pid, args, stdout
        self.stdin: Optional[IO[str]] = None  # ``start(..., stdin=True)``: the child's standard input
        self.returncode: Optional[int] = None
        self._exited = threading.Event()

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def exited(self, code: int) -> None:
        self.returncode = code
        self._exited.set()


class ForkServer:
    """``ForkServer(env=...).start(["-m", "swarm.server", ...])``: processes forked from one that preloaded modules.

    The fork server is started at once and imports in the background; the first :meth:`start` waits for it.
    :meth:`close` ends it, and with it whatever children are left (``LocalSwarm`` stops them first, gracefully).
    """

    def __init__(self, python: str = sys.executable, env: Optional[dict[str, str]] = None,
                 preload: Sequence[str] = DEFAULT_PRELOAD, startup_timeout: float = 120):
        self.startup_timeout = startup_timeout
        self.channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [python, "-m", __name__, str(theirs.fileno()), *preload], pass_fds=[theirs.fileno()], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.children: dict[int, ForkedProcess] = {}
        self.replies: "queue.Queue[dict[str, Any]]" = queue.Queue()
        self.ready, self.closed = threading.Event(), False
        self._start_lock = threading.Lock()
        threading.Thread(target=self._read, name="fork-server-reader", daemon=True).start()

    def start(self, args: Sequence[str], netns: Optional[str] = None, stdin: bool = False,
              cwd: Optional[str] = None, env: Optional[dict[str, str]] = None) -> ForkedProcess:
        """Fork a child running ``python *args`` (see :func:`forkable`) in ``cwd`` (default: this process's working
        directory); its output is the returned ``stdout``, and with ``stdin`` its standard input is the returned
        ``stdin`` (else /dev/null). ``env``: its ``os.environ`` (default: the fork server's), as an exec'd process
        would have it; what the preloaded modules read at import was the fork server's.

        ``netns``: a network namespace's file (``/run/netns/NAME``) that the child enters before it runs anything, as
        ``ip netns exec NAME python ...`` would run it (the NAT lab, ``swarm.testing.netlab``); it is inside when
        this returns."""
        if not forkable(args):
            raise ValueError(f"a fork server runs `-m MODULE ...` or `SCRIPT ...`, not {list(args)}")
        if not self.ready.wait(self.startup_timeout) or self.closed:
            raise RuntimeError(f"the fork server did not start (exit code {self.process.poll()})")
        read_end, write_end = os.pipe()
        given, keep = [write_end], [read_end]
        if stdin:
            child_input, input_end = os.pipe()
            given.append(child_input)
            keep.append(input_end)
        request = {"args": list(args), "cwd": cwd or os.getcwd(), **({"netns": netns} if netns else {}),
                   **({"env": dict(env)} if env is not None else {})}
        reply: dict[str, Any] = {"error": "not sent"}
        try:
            with self._start_lock:
                socket.send_fds(self.channel, [json.dumps(request).encode()], given)
                reply = self.replies.get(timeout=self.startup_timeout)
        except queue.Empty:
            self.close()  # a late answer would be taken for the next start's: this fork server is done
            raise RuntimeError(f"the fork server did not answer within {self.startup_timeout:.0f} s") from None
        finally:
            for fd in given + (keep if "error" in reply else []):
                os.close(fd)
        if "error" in reply:
            raise RuntimeError(f"the fork server could not start {list(args)}: {reply['error']}")
        child = reply["child"]  # registered by the reader before any exit of it can arrive
        child.stdout = open(read_end, errors="replace")  # text with universal newlines, as Popen(text=True) reads
        if stdin:
            child.stdin = open(input_end, "w")
        return child

    def close(self, timeout: float = 10) -> None:
        """Stop the fork server (it exits when its channel closes) and wait for it; children left are SIGKILLed."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.channel.shutdown(socket.SHUT_RDWR)
        self.channel.close()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _read(self) -> None:
        """Dispatch the fork server's messages in order (so a child's start is seen before its exit)."""
        while True:
            try:
                data = self.channel.recv(MAX_MESSAGE_BYTES)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "ready" in message:
                self.ready.set()
            elif "started" in message:
                child = self.children[message["started"]] = ForkedProcess(message["started"], message["args"], None)
                self.replies.put({"child": child})
            elif "exited" in message:
                self.children.pop(message["exited"]).exited(message["code"])
            else:
                self.replies.put(message)
        self._lost()

    def _lost(self) -> None:
        """The fork server is gone: nobody can report its children's exits any more, so they are stopped."""
        if not self.closed:
            logger.error("the fork server exited (code %s); stopping its %d processes", self.process.poll(),
                         len(self.children))
        self.closed = True
        self.ready.set()
        self.replies.put({"error": "the fork server exited"})
        for pid, child in list(self.children.items()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            child.exited(-signal.SIGKILL)
        self.children.clear()


# ----- the fork server's side (``python -m swarm.utils.forkserver FD MODULE...``) -----------------------------------
def serve(channel: socket.socket) -> Optional[dict[str, Any]]:
    """Answer start requests until the channel closes (returns None), forking a child for each; in a child, return
    its request, to be run by :func:`run_request` at the top of the stack."""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([channel], [], [], REAP_EVERY_S)
        if not _report_exits(channel, children):
            return None
        if not readable:
            continue
        data, fds, _, _ = socket.recv_fds(channel, MAX_MESSAGE_BYTES, 2)
        if not data:
            return None
        try:
            request = json.loads(data)
        except ValueError:
            request = None
        if not _well_formed(request) or len(fds) not in (1, 2):
            for fd in fds:
                os.close(fd)
            channel.send(json.dumps({"error": "a start request carries a command line (`-m MODULE ...` or "
                                              "`SCRIPT ...`), a working directory, one output descriptor (and "
                                              "maybe an input one), maybe a network namespace's path and maybe "
                                              "an environment"}).encode())
            continue
        sys.stdout.flush(), sys.stderr.flush()
        entered, entering = os.pipe()  # the child says here whether it entered its namespace
        server_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            die_with_parent(server_pid)
            channel.close()
            os.close(entered)
            _enter_namespace(request.get("netns"), entering)
            _become_child(fds[0], request["cwd"], fds[1] if len(fds) > 1 else None)
            if "env" in request:
                os.environ.clear()
                os.environ.update(request["env"])
            return request
        for fd in fds + [entering]:
            os.close(fd)
        with os.fdopen(entered, "rb") as said:
            failure = said.read().decode(errors="replace")
        if failure:
            os.waitpid(pid, 0)  # it exits at once; never reported as started, so never as exited
            channel.send(json.dumps({"error": f"could not enter {request['netns']}: {failure}"}).encode())
            continue
        children.add(pid)
        channel.send(json.dumps({"started": pid, "args": request["args"]}).encode())


def _well_formed(request: Any) -> bool:
    """``{"args": [str, ...], "cwd": str}`` with args a form :func:`forkable` accepts, and maybe ``"netns": str`` and
    ``"env": {str: str}``."""
    if not isinstance(request, dict) or not isinstance(request.get("cwd"), str):
        return False
    env = request.get("env", {})
    if not isinstance(request.get("netns", ""), str) or not isinstance(env, dict):
        return False
    if not all(isinstance(value, str) and key and "=" not in key and "\0" not in key + value
               for key, value in env.items()):
        return False
    args = request.get("args")
    return isinstance(args, list) and all(isinstance(arg, str) for arg in args) and forkable(args)


def _report_exits(channel: socket.socket, children: set[int]) -> bool:
    """Reap exited children and send their exit codes (False when the channel is gone)."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        children.discard(pid)
        try:
            channel.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:
            return False
    return True


def _enter_namespace(netns: Optional[str], entering: int) -> None:
    """Enter the network namespace ``netns`` (when given) and say so on ``entering``: nothing written is success,
    else the reason, and this child exits."""
    failure = ""
    if netns:
        try:
            fd = os.open(netns, os.O_RDONLY)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    failure = os.strerror(ctypes.get_errno())
            finally:
                os.close(fd)
        except OSError as error:
            failure = str(error)
    if failure:
        os.write(entering, failure.encode())
    os.close(entering)
    if failure:
        os._exit(1)


def _become_child(output: int, cwd: str, given_input: Optional[int] = None) -> None:
    """The process state ``Popen(start_new_session=True, stdout=PIPE, stderr=STDOUT)`` gives an exec'd child (and
    ``stdin=PIPE`` when the request carried an input descriptor)."""
    os.setsid()
    source = os.open(os.devnull, os.O_RDONLY) if given_input is None else given_input
    os.dup2(source, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(source)
    os.close(output)
    os.chdir(cwd)
    _fresh_module_state()


def _fresh_module_state() -> None:
    """What the preloaded modules made at import that a fresh interpreter would make anew, made anew."""
    import multiprocessing

    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # a fresh process seeds numpy's global generator from the OS; a fork would share it
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()  # new MPFuture and SharedBytes locks (no future exists yet)
    hivemind_asyncio = sys.modules.get("hivemind.utils.asyncio")
    if hivemind_asyncio is not None:
        hivemind_asyncio._AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


def run_request(request: dict[str, Any]) -> None:
    """Run ``python *args`` in this (forked) process, as the interpreter runs ``-m`` and scripts."""
    args = request["args"]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]  # runpy puts the module's file in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(args[0])
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        runpy.run_path(script, run_name="__main__")


def main() -> None:
    channel = socket.socket(fileno=int(sys.argv[1]))
    for module in sys.argv[2:]:
        importlib.import_module(module)
    freeze_loaded()  # the preloaded modules live as long as every child: their collections skip them
    channel.send(json.dumps({"ready": os.getpid()}).encode())
    request = serve(channel)
    if request is not None:  # a child: run the command here, so that its exit is the interpreter's own
        run_request(request)


if __name__ == "__main__":
    main()
