"""Every README snippet meant to run runs as written (issue 56).

Each ```python and ```bash block of the README carries a marker in the comment line above it, so that a new block
cannot go untested unnoticed:

* ``readme-test: run``: run as is (bash lines one by one, python as a script); the ``pip install`` steps of a
  command line are skipped: the test runs in the environment they made.
* ``readme-test: swarm-start`` / ``swarm-use`` / ``swarm``: the "swarm by hand" terminals, run for real in order:
  the long-running commands (a bootstrap peer, servers) are started and waited for, then the commands and the Python
  snippet that use the swarm run against them. The README's ports and its ``Qm...`` placeholder are replaced by free
  ports and the address the bootstrap peer printed, as a reader copies it.
* ``readme-test: skip (why)``: never run; the reason says what checks it instead.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from swarm.utils.local_swarm import LocalSwarm

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- readme-test: ([a-z-]+)(?: \(([^)]*)\))? -->\n```(\w+)\n(.*?)```", re.S)
KINDS = ("run", "skip", "swarm", "swarm-start", "swarm-use")
PLACEHOLDER = re.compile(r"/ip4/127\.0\.0\.1/tcp/31337/p2p/Qm\.\.\.")
README_PORTS = ("31337", "31338", "31339")
TIMEOUT = 600  # seconds a snippet may take: the quick start starts a swarm (75 s quiet, minutes on busy cores)


@dataclass(frozen=True)
class Snippet:
    kind: str
    why: str
    language: str
    code: str


def snippets() -> list[Snippet]:
    text = (ROOT / "README.md").read_text()
    return [Snippet(kind, why or "", language, code) for kind, why, language, code in MARKER.findall(text)]


def commands(code: str) -> list[str]:
    """A bash block's command lines: comments and blank lines dropped, ``pip install`` steps taken out."""
    lines = []
    for line in code.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        steps = [step.strip() for step in line.split("&&") if not step.strip().startswith("pip install")]
        if steps:
            lines.append(" && ".join(steps))
    return lines


def test_every_python_and_bash_block_of_the_readme_is_marked():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(python|bash)\n", text)
    marked = snippets()
    assert len(marked) == len(blocks), "a ```python or ```bash block without a readme-test marker above it"
    assert {snippet.kind for snippet in marked} <= set(KINDS)
    assert all(snippet.why for snippet in marked if snippet.kind == "skip"), "a skipped block says why"
    assert {"run", "swarm", "swarm-start", "swarm-use"} <= {snippet.kind for snippet in marked}


def run_python(code: str, cwd: Path) -> None:
    """A ```python block run as a script (``__name__ == "__main__"``), in this process from the folder ``cwd``: the
    code is the point, not a second interpreter, whose start (torch's import) costs 1.5-2 CPU s. An error in the
    block is raised here with the block's traceback."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(here)


def python_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout's package, wherever the snippet runs
    env.pop("SWARM_INITIAL_PEERS", None)
    return env


@pytest.mark.swarm  # the quick start starts a swarm of its own
@pytest.mark.timeout(2 * TIMEOUT)
def test_the_snippets_that_run_alone_run(tmp_path):
    ran = 0
    for snippet in snippets():
        if snippet.kind != "run":
            continue
        if snippet.language == "python":
            run_python(snippet.code, tmp_path)
        else:
            for line in commands(snippet.code):
                done = subprocess.run(line, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
                                      env=python_env(), executable="/bin/bash")
                assert done.returncode == 0, (line, done.stdout[-2000:], done.stderr[-3000:])
                if "examples/local_swarm.py" in line:
                    assert "identical to the swarm's: True" in done.stdout, done.stdout[-2000:]
        ran += 1
    assert ran >= 2


def free_ports(count: int) -> list[str]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [str(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.swarm
@pytest.mark.timeout(2 * TIMEOUT)
def test_the_swarm_by_hand_runs_as_the_readme_says(tmp_path):
    ports = dict(zip(README_PORTS, free_ports(len(README_PORTS))))

    def localised(code: str, address: str = "") -> str:
        code = PLACEHOLDER.sub(address, code) if address else code  # the address already has its real port
        for readme_port, port in ports.items():
            code = code.replace(f"tcp/{readme_port}", f"tcp/{port}")
        return code.replace("bootstrap.key", str(tmp_path / "bootstrap.key"))

    blocks = snippets()
    # Each command forked from one process that imported torch and hivemind (swarm.utils.forkserver, whose tests
    # check a forked command against an exec'd one): the same commands, about 2 CPU s less each
    with LocalSwarm(env={"PYTHONPATH": str(ROOT)}, startup_timeout=180, fork_server=True) as swarm:
        address = ""
        for snippet in [s for s in blocks if s.kind == "swarm-start"]:
            for line in commands(localised(snippet.code, address)):
                if line.startswith("export "):
                    name, _, value = line[len("export "):].partition("=")
                    swarm.env[name] = value
                    continue
                args = shlex.split(line)
                assert args[0] == "python", line
                managed = swarm.start_command(" ".join(args[2:5]), args[1:])
                swarm.wait_ready(managed)  # its READY line
                if args[2] == "swarm.dht":
                    swarm.bootstrap = managed
                    address = managed.maddrs[0]
                    assert f"tcp/{ports['31337']}/p2p/" in address
        assert address and len(swarm.processes) == 3, "a bootstrap peer and two servers"
        for snippet in [s for s in blocks if s.kind in ("swarm-use", "swarm")]:
            code = localised(snippet.code, address)
            assert "Qm..." not in code
            if snippet.language == "python":
                run_python(code, tmp_path)
                continue
            env = dict(python_env())
            for line in commands(code):
                if line.startswith("export "):
                    name, _, value = line[len("export "):].partition("=")
                    env[name] = value
                    continue
                args = shlex.split(line)
                assert args[0] == "python", line
                code, output = swarm.run_command(args[1:], env=env, cwd=str(tmp_path), timeout=TIMEOUT)
                assert code == 0, (line, output[-4000:])  # stdout and stderr together
                if "swarm.health" in line:
                    assert "OK: every block is served" in output, output
                if "--json" in line:
                    printed = [text for text in output.splitlines() if text.startswith("{")]
                    assert len(printed) == 1, output
                    record = json.loads(printed[0])
                    assert record["prompt"] == "The government said" and "text" in record
                elif "swarm.generate" in line:
                    assert "ran: " in output and "[0:8]" in output, output
