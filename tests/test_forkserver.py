"""A process forked by the fork server runs as ``python -m MODULE`` or ``python SCRIPT`` would (utils.forkserver).

The tests start their servers so (``LocalSwarm(fork_server=True)``): what a user runs is exec'd, so
each difference a fork could make is checked here against what the interpreter does. That forked servers keep the
daemon guarantees (``kill -9`` takes their daemons) is ``test_daemons.py``'s kill test, run both ways.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import psutil
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from swarm.utils.forkserver import ForkServer, _well_formed
from tests.conftest import wait_until

REPORT = """import gc, json, os, random, sys
import numpy
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
                  "session_leader": os.getsid(0) == os.getpid(), "stdin": sys.stdin.read(), "env": os.environ.get("X"),
                  "random": random.random(), "numpy": float(numpy.random.random()),
                  "frozen": gc.get_freeze_count()}), flush=True)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def forks():
    server = ForkServer(env=dict(os.environ, X="from the environment"), preload=("numpy",))
    yield server
    server.close()


def report(tmp_path: Path, forks: ForkServer, code: int, env: Optional[dict[str, str]] = None) -> dict:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    child = forks.start([str(script), str(code)], env=env)
    assert child.wait(30) == code
    return json.loads(child.stdout.read())


def test_a_forked_script_sees_what_an_execd_one_sees(forks, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the caller's working directory at the start, as Popen gives it
    script = str(tmp_path / "report.py")
    forked = report(tmp_path, forks, 3)
    execd = subprocess.run([sys.executable, script, "3"], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                           env=dict(os.environ, X="from the environment"), start_new_session=True)
    assert execd.returncode == 3
    execd = json.loads(execd.stdout)
    same = ("argv", "path0", "cwd", "name", "session_leader", "stdin", "env")
    assert {key: forked[key] for key in same} == {key: execd[key] for key in same}
    assert forked["argv"] == [script, "3"] and forked["session_leader"] and forked["cwd"] == str(tmp_path)
    # the one difference made on purpose: the preloaded modules' objects are frozen (swarm.utils.collector), so the
    # child's full collections skip them
    assert forked["frozen"] > 1000 and execd["frozen"] == 0, (forked["frozen"], execd["frozen"])
    other = report(tmp_path, forks, 0)
    assert other["random"] != forked["random"] and other["numpy"] != forked["numpy"], "siblings share a generator"
    # a start's own variables over the fork server's environment, as Popen(env=...) gives an exec'd command; only its
    assert report(tmp_path, forks, 0, env={"X": "its own"})["env"] == "its own"
    assert report(tmp_path, forks, 0)["env"] == "from the environment"


def test_a_forked_module_gets_its_arguments_exit_codes_and_output(forks):
    usage = forks.start(["-m", "json.tool", "--no-such-flag"])
    assert usage.wait(30) == 2
    assert "unrecognized arguments: --no-such-flag" in usage.stdout.read()  # stderr goes where stdout goes
    crash = forks.start(["-m", "swarm.utils.forkserver"])  # no channel argument: a traceback
    assert crash.wait(30) == 1
    assert "IndexError" in crash.stdout.read()


def test_signals_reach_a_forked_process_and_its_session(forks, tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    children = [forks.start([str(script)]) for _ in range(2)]
    for child in children:
        assert child.stdout.readline() == "up\n"
    children[0].terminate()
    os.killpg(children[1].pid, signal.SIGKILL)  # what LocalSwarm.terminate does for a crash
    assert [child.wait(10) for child in children] == [-signal.SIGTERM, -signal.SIGKILL]
    with pytest.raises(subprocess.TimeoutExpired):
        forks.start([str(script)]).wait(0.2)  # and the fork server still serves (its leftover stops with it)


def test_a_forked_process_gets_the_environment_input_and_folder_it_is_given(forks, tmp_path):
    """What ``LocalSwarm`` passes at each start (its environment as it is then) and the NAT lab's client needs (a
    pipe to its standard input, the package's folder)."""
    script = tmp_path / "echo.py"
    script.write_text("import os, sys\nprint(os.environ.get('X'), os.environ.get('Y'), os.getcwd(), "
                      "sys.stdin.readline().strip(), flush=True)\n")
    child = forks.start([str(script)], env={"Y": "given"}, stdin=True, cwd=str(tmp_path))
    child.stdin.write("typed\n")
    child.stdin.flush()
    assert child.wait(30) == 0
    assert child.stdout.read().split() == ["None", "given", str(tmp_path), "typed"]


@pytest.mark.lab
def test_a_forked_process_runs_in_the_network_namespace_it_is_given(forks, tmp_path):
    """``start(..., netns=)``: inside the namespace before it runs anything, as ``ip netns exec`` runs it (the NAT
    lab's peers, servers and clients); a namespace it cannot enter is an error, and nothing runs."""
    from swarm.testing.netlab import unavailable_reason

    if unavailable_reason():
        pytest.skip(f"network namespaces unavailable: {unavailable_reason()}")
    name = f"swnat-{os.getpid()}-forktest"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        script = tmp_path / "where.py"
        script.write_text("import os\nprint(os.stat('/proc/self/ns/net').st_ino, flush=True)\n")
        child = forks.start([str(script)], netns=f"/run/netns/{name}")
        assert child.wait(30) == 0
        assert int(child.stdout.read()) == os.stat(f"/run/netns/{name}").st_ino != os.stat("/proc/self/ns/net").st_ino
        with pytest.raises(RuntimeError, match="could not enter /run/netns/no-such"):
            forks.start([str(script)], netns="/run/netns/no-such")
        assert forks.start(["-m", "json.tool", "--help"]).wait(30) == 0  # and it still serves
    finally:
        subprocess.run(["ip", "netns", "del", name])


def test_commands_it_cannot_fork_and_malformed_requests_are_refused(forks):
    with pytest.raises(ValueError, match="-m MODULE"):
        forks.start(["-c", "print(1)"])
    forks.channel.send(json.dumps({"args": ["x.py"], "cwd": "/"}).encode())  # no output descriptor
    assert "one output descriptor" in forks.replies.get(timeout=10)["error"]
    read_end, write_end = os.pipe()
    for malformed in (b"[1, 2]", b"{not json", json.dumps({"args": ["-c", "1"], "cwd": "/"}).encode(),
                      json.dumps({"args": [3], "cwd": "/"}).encode(), json.dumps({"args": ["x.py"]}).encode(),
                      json.dumps({"args": ["x.py"], "cwd": "/", "netns": 1}).encode(),
                      *(json.dumps({"args": ["x.py"], "cwd": "/", "env": env}).encode()
                        for env in (["X"], {"X": 1}, {"": "1"}, {"A=B": "1"}, {"X": "a\0b"}))):
        socket.send_fds(forks.channel, [malformed], [write_end])
        assert "a start request carries" in forks.replies.get(timeout=10)["error"]
    os.close(read_end), os.close(write_end)
    assert forks.start(["-m", "json.tool", "--help"]).wait(30) == 0


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
REQUESTS = (st.binary(max_size=300) | JSON.map(lambda value: json.dumps(value).encode())
            | st.fixed_dictionaries({"args": JSON, "cwd": JSON}, optional={"netns": JSON, "env": JSON})
            .map(lambda value: json.dumps(value).encode()))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(packet=REQUESTS)
def test_no_malformed_start_request_starts_anything_or_stops_the_fork_server(forks, packet):
    try:
        assume(not _well_formed(json.loads(packet)))
    except ValueError:
        pass  # not JSON at all
    before = set(forks.children)  # an earlier test's sleeper may still run
    read_end, write_end = os.pipe()
    try:
        socket.send_fds(forks.channel, [packet or b" "], [write_end])
        assert "a start request carries" in forks.replies.get(timeout=10)["error"]
    finally:
        os.close(read_end), os.close(write_end)
    assert forks.process.poll() is None and set(forks.children) <= before


def test_the_children_of_a_fork_server_that_dies_are_stopped(tmp_path, caplog):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    forks = ForkServer(preload=())
    child = forks.start([str(script)])
    assert child.stdout.readline() == "up\n"
    forks.process.kill()
    assert child.wait(10) == -signal.SIGKILL
    assert wait_until(lambda: _gone(child.pid), timeout=10)
    assert "the fork server exited" in caplog.text
    with pytest.raises(RuntimeError, match="did not start"):
        forks.start([str(script)])
    forks.close()


OWNER = """import json, os, signal, sys, time
from swarm.utils.forkserver import ForkServer
forks = ForkServer(preload=())
child = forks.start([sys.argv[1]])
assert child.stdout.readline() == "up\\n"
print(json.dumps({"child": child.pid, "fork_server": forks.process.pid}), flush=True)
if sys.argv[2] == "exit":
    os._exit(0)  # no teardown: the fork server sees its channel close
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["the owner exits without closing it", "the fork server dies unseen"])
def test_no_child_outlives_its_fork_server(tmp_path, how):
    """An owner that exits without its teardown (an xdist worker stopped, os._exit) once left its swarm's servers
    running for hours; and a fork server killed while its owner cannot react (stopped here) left its children."""
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(sleeper), "exit" if "exits" in how else "stay"],
                             stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(owner.stdout.readline())
        if "dies" in how:
            owner.send_signal(signal.SIGSTOP)
            os.kill(pids["fork_server"], signal.SIGKILL)
        assert wait_until(lambda: _gone(pids["fork_server"]) and _gone(pids["child"]), timeout=20)
    finally:
        owner.kill()
        owner.wait()
        for pid in pids.values() if "pids" in locals() else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaped yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
