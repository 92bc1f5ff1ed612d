"""Every command's mistakes end in one line and a documented exit code; halts are visible (issue 20).

The error path is :class:`swarm.cli.options.OneLineErrors`: these tests drive the real commands (in process with
click's runner, or as subprocesses where the whole output matters) into the mistakes a newcomer makes.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner, Result

from swarm.cli.options import (
    EXIT_CODES,
    EXIT_HALTED,
    EXIT_IN_USE,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_NOT_SERVED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    OneLineErrors,
    SwarmCommand,
    default_threads,
    run_main,
    utc_time,
)
from swarm.dht.node import NetworkConfig
from swarm.dht.peers import ENV_BOOTSTRAP_FILE, ENV_PEERS, check_peer_multiaddr, resolve_initial_peers
from swarm.governance.keys import generate_private_key, public_key_text
from tests.conftest import make_checkpoint, stop_all, tiny_config

ROOT = Path(__file__).resolve().parent.parent
DEAD_PEER = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWRJaumqk3B8gSfjnNoP38rNHSXe69Tw2JKm8EYLuU1zCQ"


def commands() -> dict[str, click.Command]:
    from swarm.api.__main__ import main as api
    from swarm.audit.__main__ import main as audit
    from swarm.benchmark import main as benchmark
    from swarm.dht.__main__ import main as dht
    from swarm.eval.__main__ import main as evaluate
    from swarm.generate import main as generate
    from swarm.governance.__main__ import main as governance
    from swarm.health.__main__ import main as health
    from swarm.server.__main__ import main as server
    from swarm.train.__main__ import main as train

    return {"generate": generate, "api": api, "server": server, "dht": dht, "governance": governance,
            "train": train, "eval": evaluate, "health": health, "benchmark": benchmark, "audit": audit}


def run(name: str, *args: str, env: dict | None = None) -> Result:
    return CliRunner().invoke(commands()[name], list(args), env=env, catch_exceptions=False)


def error_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def assert_one_line(result: Result, code: int, *fragments: str) -> str:
    """The command failed with ``code`` and said so on stderr in one line holding every fragment."""
    lines = error_lines(result)
    assert result.exit_code == code, (result.exit_code, result.output)
    assert len(lines) == 1 and lines[0].startswith("Error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """Commands run in this process set torch's thread count (--threads): give the next test its count back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_default_peers(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_PEERS, raising=False)
    monkeypatch.setenv(ENV_BOOTSTRAP_FILE, str(tmp_path / "no-bootstrap-peers.txt"))


@pytest.fixture
def busy_port():
    """A port another process listens on (a plain socket, as any program would hold it)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


# ----- every command ---------------------------------------------------------------------------------------
def test_every_command_shares_the_error_path_verbose_and_threads():
    for name, command in commands().items():
        assert isinstance(command, OneLineErrors), name
        assert "verbose" in [p.name for p in command.params], name
    for name in ("generate", "api", "server", "train", "eval"):
        flags = [flag for p in commands()[name].params for flag in p.opts]
        assert "--threads" in flags, name
    assert "--compute-threads" in [f for p in commands()["server"].params for f in p.opts], "the old name stays"


def test_the_exit_codes_are_the_documented_table():
    text = (ROOT / "docs" / "OPERATIONS.md").read_text()
    section = text[text.index("### Exit codes"):]
    documented = {int(code) for code in re.findall(r"^\| `(\d+)` \|", section, re.M)}
    assert documented == set(EXIT_CODES)
    for code in (EXIT_NOT_SERVED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_IN_USE, EXIT_HALTED):
        assert f"`{code}`" in section


def test_an_unexpected_error_is_one_line_and_its_traceback_needs_verbose(monkeypatch, capsys):
    """A bug: ``python -m`` (run_main) prints one line and exits 70; a Python caller still gets the exception."""
    @click.command(cls=SwarmCommand)
    def broken() -> None:
        raise RuntimeError("boom\nsecond line")

    @click.command(cls=SwarmCommand)
    def interrupted() -> None:
        raise KeyboardInterrupt

    for argv, traceback_shown in ((["broken"], False), (["broken", "--verbose"], True)):
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as exit_:
            run_main(broken)
        stderr = capsys.readouterr().err
        assert exit_.value.code == EXIT_INTERNAL and ("Traceback" in stderr) == traceback_shown
        assert stderr.splitlines()[-1] == ("Error: internal error: RuntimeError: boom second line (a bug: run again "
                                           "with --verbose and report the traceback)")
        assert len(stderr.splitlines()) == 1 or traceback_shown
    with pytest.raises(RuntimeError, match="boom"):
        CliRunner().invoke(broken, [], catch_exceptions=False)
    assert_one_line(CliRunner().invoke(interrupted, []), EXIT_INTERRUPTED, "interrupted")


@pytest.mark.swarm
def test_a_malformed_initial_peer_is_one_line_from_the_real_process():
    """The issue's 44-line traceback: now the command's whole stderr is one line; --verbose shows the rest."""
    command = [sys.executable, "-m", "swarm.generate", "Hi", "--initial-peers", "127.0.0.1:31337"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == EXIT_USAGE
    assert done.stderr.strip().splitlines() == [
        "Error: --initial-peers: '127.0.0.1:31337' is not a peer's multiaddr; expected "
        "/ip4/203.0.113.5/tcp/31337/p2p/Qm..., as printed by the bootstrap peer or a server"]
    verbose = run("generate", "Hi", "--initial-peers", "127.0.0.1:31337", "--verbose")
    assert verbose.exit_code == EXIT_USAGE and "Traceback" in verbose.stderr


# ----- answered at once (issue 37 items 1 and 2) -------------------------------------------------------------
HEAVY_MODULES = ("torch", "hivemind", "transformers", "fastapi", "uvicorn")
# Every ``python -m`` command of the package: its --help, and each of its subcommands', loads none of HEAVY_MODULES.
MODULE_COMMANDS = ("swarm.generate", "swarm.eval.text_quality", "swarm.eval.composition", "swarm.train.tokenizer",
                   "swarm.improve.demo", "swarm.improve.streams_demo")
COMMANDS = ("swarm.server", "swarm.api", "swarm.dht", "swarm.health", "swarm.governance", "swarm.train", "swarm.eval",
            "swarm.finetune", "swarm.benchmark", "swarm.weights", "swarm.audit", "swarm.improve", "swarm.advise",
            *MODULE_COMMANDS)
# Runs commands as ``python -m MODULE ARGS`` would, each (MODULE, ARGS) of a JSON list in turn, in one interpreter,
# each run's output captured; then prints, per run, the heavy modules loaded before it and after it, its exit code
# and its stderr (the last stdout line, as JSON). It stops after a run that loaded a heavy module: the runs after it
# could not be checked there (the module is loaded already), so they go to a fresh interpreter.
IMPORTS_PROBE = """
import contextlib, io, json, runpy, sys
def heavy():
    return sorted(name for name in {heavy} if name in sys.modules)
results = []
for module, args in json.loads(sys.argv[1]):
    before, out, err = heavy(), io.StringIO(), io.StringIO()
    sys.argv = [module, *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = exit_.code
        except Exception as error:
            code = f"raised {error!r}"
    results.append([before, heavy(), code, err.getvalue()])
    if results[-1][1]:
        break
print(json.dumps(results))
""".replace("{heavy}", repr(HEAVY_MODULES))


def probe_imports(runs: list[tuple[str, list[str]]]) -> dict[tuple[str, tuple[str, ...]], tuple]:
    """(MODULE, ARGS) -> (heavy modules loaded before the run, after it, exit code, stderr), for every run of
    ``python -m MODULE ARGS`` in ``runs``, in one fresh interpreter (one start instead of one per module and
    mistake: 40 interpreters took about 12 CPU s), and one more after each run that loaded a heavy module."""
    results: list = []
    while len(results) < len(runs):
        done = subprocess.run([sys.executable, "-c", IMPORTS_PROBE, json.dumps(runs[len(results):])],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0 and done.stdout.strip(), done.stderr[-4000:]
        results += json.loads(done.stdout.strip().splitlines()[-1])
    return {(module, tuple(args)): tuple(result) for (module, args), result in zip(runs, results)}


def heavy_imports(probed: dict, module: str, args: list[str]) -> tuple[list[str], object, str]:
    """(heavy modules the run loaded, its exit code, its stderr) of ``python -m module ARGS`` in ``probed`` (a run
    whose interpreter had loaded a heavy module before it could not be checked, and fails saying so)."""
    before, after, code, stderr = probed[module, tuple(args)]
    assert before == [], f"python -m {module} {' '.join(args)} was not checked: an earlier run loaded {before}"
    return after, code, stderr


def subcommands(module: str) -> list[str]:
    """What ``python -m module NAME`` runs: a click group's commands, and ``swarm.finetune publish``,
    ``swarm.improve withdraw`` and ``swarm.improve coordinate`` (which their ``__main__`` dispatches itself)."""
    entry = importlib.import_module(f"{module}.__main__" if (ROOT / module.replace(".", "/")).is_dir() else module)
    return (sorted(getattr(entry.main, "commands", {})) + (["publish"] if module == "swarm.finetune" else [])
            + (["withdraw", "coordinate"] if module == "swarm.improve" else []))


def help_runs(module: str) -> list[list[str]]:
    return [["--help"]] + [[name, "--help"] for name in subcommands(module)]


@pytest.fixture(scope="module")
def probed() -> dict:
    """Every help run of every command and every argument mistake below, run in one fresh interpreter."""
    return probe_imports([(module, args) for module in COMMANDS for args in help_runs(module)]
                         + [(module, args) for module, args, _ in MISTAKES])


def test_every_command_is_in_the_fast_help_check():
    """A new ``python -m`` command is checked too."""
    packages = {f"swarm.{path.parent.name}" for path in (ROOT / "swarm").glob("*/__main__.py")}
    assert packages | set(MODULE_COMMANDS) == set(COMMANDS)


@pytest.mark.swarm  # a fresh Python process
@pytest.mark.parametrize("module", COMMANDS)
def test_every_help_is_answered_before_torch_hivemind_or_fastapi_loads(module, probed):
    """``python -m swarm.dht --help`` (governance, health, train, eval, finetune, benchmark, weights alike) imported
    torch and hivemind before parsing (2.5-4 s on a busy machine, 5-9 s in the issue); swarm.api's imported FastAPI."""
    for args in help_runs(module):
        heavy, code, stderr = heavy_imports(probed, module, args)
        assert code == 0, stderr
        assert heavy == [], f"python -m {module} {' '.join(args)} imported {heavy}"


MISTAKES = [
    ("swarm.server", ["--blocks", "0-8"], "Invalid value for '--blocks': expected START:END"),
    ("swarm.server", ["--num-blocks", "0"], "is not in the range x>=1"),
    ("swarm.server", ["--max-batch-tokens", "lots"], "'lots' is not a valid integer"),
    ("swarm.generate", ["Hi", "--remasking", "nope"], "'nope' is not one of"),
    ("swarm.generate", ["Hi", "--request-timeout", "0"], "is not in the range x>0.0"),
    ("swarm.api", ["--port", "x"], "'x' is not a valid integer range"),
    ("swarm.dht", ["--num-blocks", "-1"], "-1 is not in the range 0<=x<=100000"),
    ("swarm.dht", ["--initial-peers", "127.0.0.1:31337"], "is not a peer's multiaddr"),
    ("swarm.health", ["--port", "70000"], "70000 is not in the range 0<=x<=65535"),
    ("swarm.governance", ["status"], "Missing option '--governance-key'"),
    ("swarm.train", ["--output", "run", "--corpus", "nope"], "'nope' is not one of 'prose', 'python', 'addition'"),
    ("swarm.eval", ["--task", "nope"],
     "'nope' is not one of 'addition', 'tagged-addition', 'bracketed-addition', 'dotted-addition', 'host-blocks', "
     "'none'"),
    ("swarm.finetune", ["--data", "README.md", "--output", "out", "--rank", "0"], "0 is not in the range 1<=x<=128"),
    ("swarm.finetune", ["--data", "README.md", "--output", "out", "--target-batch-size", "4"],
     "--target-batch-size needs --run-id"),
    ("swarm.finetune", ["publish"], "Missing argument 'DIRECTORY'"),
    ("swarm.benchmark", ["picard", "--windows", "0"], "expected values >= 1, got '0'"),
    ("swarm.weights", ["show"], "Missing argument 'REFERENCE'"),
    ("swarm.audit", ["--key", "k", "--every", "0"], "0.0 is not in the range 0.0<x<=604800.0"),
    ("swarm.audit", [], "Missing option '--key'"),
    ("swarm.audit", ["--key", "k", "--score-adapters", "nope"], "--score-adapters: unknown task 'nope'"),
]


@pytest.mark.swarm  # a fresh Python process
@pytest.mark.parametrize("module, args, fragment", MISTAKES)
def test_argument_mistakes_are_answered_before_torch_loads(module, args, fragment, probed):
    """A typo in --blocks took 9-16 s: torch, hivemind and transformers loaded first."""
    heavy, code, stderr = heavy_imports(probed, module, args)
    assert code == EXIT_USAGE and fragment in stderr, stderr
    assert heavy == [], f"{module} {' '.join(args)} imported {heavy}"


def test_the_task_names_the_options_offer_are_the_tasks_the_code_knows():
    """``--task`` is declared from swarm/train/config.py (no torch for --help); the tasks live in swarm.train.data."""
    from swarm.train.config import TASK_NAMES
    from swarm.train.data import TASKS

    assert tuple(TASKS) == TASK_NAMES


def test_request_settings_are_checked_before_joining_a_swarm(no_default_peers):
    """``--gen-length 5000`` was refused only after joining the swarm (33 s); the dead peer is never dialled."""
    result = run("generate", "Hi", "--gen-length", "5000", "--initial-peers", DEAD_PEER)
    assert_one_line(result, EXIT_USAGE, "gen_length (5000) + a prompt exceeds the model's context")


# ----- bad values --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, args, fragment", [
    ("generate", ["Hi", "--model", "/nonexistent"], "is no embedded model (embedded: "),
    ("generate", ["Hi", "--gen-length", "7", "--block-length", "3"], "divisible"),
    ("api", ["--local", "--model", "/nonexistent", "--port", "0"], "neither a checkpoint directory"),
    ("eval", ["--model", "/nonexistent"], "neither a checkpoint directory"),
    ("server", ["--num-blocks", "40", "--throughput", "1"], "--num-blocks 40 must be 1..16"),
    ("server", ["--blocks", "0:8", "--num-blocks", "4", "--throughput", "1"], "not both"),
    ("server", ["--blocks", "0:99", "--throughput", "1"], "not inside the model's 16 blocks"),
    ("server", ["--host-maddrs", "0.0.0.0:31338"], "--host-maddrs: '0.0.0.0:31338' is not a multiaddr"),
    ("dht", ["--initial-peers", "/ip4/127.0.0.1/tcp/31337"], "is not a peer's multiaddr"),
    ("health", ["--dht-prefix", "m", "--num-blocks", "2", "--initial-peers", "/ip4/1.2.3/tcp/1/p2p/x"],
     "is not a valid multiaddr"),
])
def test_bad_values_are_refused_in_one_line(name, args, fragment, no_default_peers):
    assert_one_line(run(name, *args), EXIT_USAGE, fragment)


def test_click_range_checks_refuse_zero_blocks_and_zero_threads():
    """--num-blocks 0 once served the whole model; click's own message, exit 2, no traceback."""
    for name, args in (("server", ["--num-blocks", "0"]), ("generate", ["Hi", "--threads", "0"]),
                       ("train", ["--output", "x", "--steps", "0"])):
        result = run(name, *args)
        assert result.exit_code == EXIT_USAGE and "Traceback" not in result.output
        assert "is not in the range" in result.stderr


def test_health_and_governance_without_any_peer_say_so(no_default_peers, tmp_path):
    """They once started a DHT of their own and reported it empty (health: exit 1, 'not served')."""
    result = run("health", "--dht-prefix", "m", "--num-blocks", "2")
    assert result.exit_code == EXIT_USAGE and "no swarm to ask: pass --initial-peers" in result.stderr
    key = tmp_path / "gov.key"
    generate_private_key(key)
    result = run("governance", "halt", "--key", str(key))
    assert result.exit_code == EXIT_USAGE and "no swarm to join: pass --initial-peers" in result.stderr


def test_the_auditor_says_what_is_missing_in_one_line(no_default_peers, tmp_path):
    """No swarm to audit, and a key file that is missing, a public key or no key at all: one line each."""
    key = tmp_path / "auditor.key"
    public = tmp_path / "auditor.key.pub"
    public.write_text(public_key_text(generate_private_key(key)) + "\n")
    assert_one_line(run("audit", "--key", str(key)), EXIT_USAGE, "no swarm to audit: pass --initial-peers")
    peers = ("--initial-peers", DEAD_PEER)
    assert_one_line(run("audit", "--key", str(tmp_path / "nope.key"), *peers), EXIT_USAGE, "is no file",
                    "python -m swarm.governance keygen")
    assert_one_line(run("audit", "--key", str(public), *peers), EXIT_USAGE, "is not an auditor private key",
                    "it holds a public key; give the private key file (auditor.key)")
    junk = tmp_path / "junk.key"
    junk.write_text("hello")
    assert_one_line(run("audit", "--key", str(junk), *peers), EXIT_USAGE, "is not an auditor private key")


def test_governance_halt_given_the_public_key_says_which_file_to_give(tmp_path):
    key = tmp_path / "governance.key"
    public = tmp_path / "governance.key.pub"
    public.write_text(public_key_text(generate_private_key(key)) + "\n")
    result = run("governance", "halt", "--key", str(public), "--initial-peers", DEAD_PEER)
    assert result.exit_code == EXIT_USAGE
    assert "holds a public key; give the private key file (governance.key)" in result.stderr
    assert "Traceback" not in result.output


def test_peer_multiaddrs_are_checked_where_they_come_from(monkeypatch, tmp_path):
    assert check_peer_multiaddr(DEAD_PEER) == DEAD_PEER
    with pytest.raises(ValueError, match=r"^--initial-peers: '127.0.0.1:31337' is not a peer's multiaddr"):
        check_peer_multiaddr("127.0.0.1:31337")
    monkeypatch.setenv(ENV_PEERS, f"{DEAD_PEER}, /ip4/127.0.0.1/tcp/5")
    with pytest.raises(ValueError, match=r"^\$SWARM_INITIAL_PEERS: '/ip4/127.0.0.1/tcp/5'"):
        resolve_initial_peers([])
    monkeypatch.delenv(ENV_PEERS)
    listing = tmp_path / "peers.txt"
    listing.write_text(f"# bootstrap\n{DEAD_PEER}\nlocalhost:1\n")
    monkeypatch.setenv(ENV_BOOTSTRAP_FILE, str(listing))
    with pytest.raises(ValueError, match=re.escape(f"{listing}: 'localhost:1'")):
        resolve_initial_peers([])


def test_training_refuses_an_architecture_flag_that_a_resume_would_ignore(tmp_path):
    """The issue: a resumed run recorded hidden_size 32 in training.json while config.json said 64."""
    from swarm.train.data import TextCorpus
    from swarm.train.loop import TRAINING_INFO_FILE, TrainConfig, train

    data = tmp_path / "data.txt"
    data.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 50)
    args = ["--output", str(tmp_path / "run"), "--data", str(data), "--steps", "1", "--batch-size", "2",
            "--seq-len", "16", "--hidden-size", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2",
            "--intermediate-size", "32", "--threads", "1"]
    assert run("train", *args).exit_code == 0
    changed = args[:11] + ["32"] + args[12:]
    changed[5] = "2"  # --steps 2: a real resume
    assert_one_line(run("train", *changed), EXIT_USAGE, "--hidden-size 32 (the checkpoint has 64)", "drop the flag")
    # A library caller is not refused, but what it records is what was trained.
    cfg = TrainConfig(output=str(tmp_path / "run"), corpus="files", steps=2, batch_size=2, seq_len=16,
                      hidden_size=32, layers=1, heads=4, kv_heads=2, intermediate_size=32, threads=1)
    train(cfg, TextCorpus(data.read_bytes(), "toy"))
    info = json.loads((tmp_path / "run" / TRAINING_INFO_FILE).read_text())
    assert info["step"] == 2 and info["train_config"]["hidden_size"] == 64


def test_training_logs_how_long_the_run_will_take(tmp_path, caplog):
    from swarm.train.data import TextCorpus
    from swarm.train.loop import TrainConfig, train

    cfg = TrainConfig(output=str(tmp_path / "run"), corpus="files", steps=5, batch_size=2, seq_len=16,
                      hidden_size=16, layers=1, heads=2, kv_heads=1, intermediate_size=16, threads=1)
    with caplog.at_level("INFO", logger="swarm.train.loop"):
        train(cfg, TextCorpus(b"abc " * 400, "toy"))
    assert re.search(r"s per step: about \d+ s for the 2 steps left", caplog.text), caplog.text


# ----- threads and the server's first line -------------------------------------------------------------------
def test_default_threads_leave_room_for_the_rest_of_the_swarm(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    import os

    cpus = len(os.sched_getaffinity(0))
    assert default_threads() == max(1, cpus // 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3


def test_a_server_that_joined_through_the_environment_does_not_claim_a_new_swarm(monkeypatch, no_default_peers):
    from swarm.server.__main__ import join_message

    addrs = ["/ip4/127.0.0.1/tcp/5/p2p/12D3KooWSelf"]
    assert join_message(NetworkConfig(), addrs).startswith("Started a new swarm. Others join with: --initial-peers")
    monkeypatch.setenv(ENV_PEERS, DEAD_PEER)  # the README's own method
    assert join_message(NetworkConfig(), addrs).startswith("Joined the swarm through 1 initial peer;")
    assert join_message(NetworkConfig(initial_peers=[DEAD_PEER]), addrs).startswith("Joined")


# ----- ports and swarms that cannot be reached ---------------------------------------------------------------
@pytest.mark.swarm
@pytest.mark.parametrize("name", ["server", "dht", "api"])
def test_a_port_in_use_is_refused_before_anything_loads(name, busy_port, no_default_peers, monkeypatch):
    from swarm.models.checkpoint import CheckpointReader

    maddr = f"/ip4/127.0.0.1/tcp/{busy_port}"
    args = {"server": ["--host-maddrs", maddr, "--blocks", "0:8"], "dht": ["--host-maddrs", maddr],
            "api": ["--local", "--port", str(busy_port)]}[name]
    opened = []  # every checkpoint a command reads opens it here: none may be, before the port is refused
    monkeypatch.setattr(CheckpointReader, "__init__", lambda self, *a, **k: opened.append(a) or pytest.fail("loaded"))
    assert_one_line(run(name, *args), EXIT_IN_USE, f"port {busy_port} (tcp) is already in use")
    assert opened == [], "refused at start, not after loading the model"


@pytest.mark.swarm
def test_an_unreachable_bootstrap_peer_has_its_own_exit_code(no_default_peers):
    assert_one_line(run("generate", "Hi", "--initial-peers", DEAD_PEER), EXIT_UNREACHABLE,
                    "could not reach any initial peer", DEAD_PEER)


def test_missing_blocks_exit_as_not_served(local_swarm, tmp_path):
    unserved = make_checkpoint(tmp_path / "nobody-serves-this", tiny_config(), seed=21)
    result = run("generate", "Hi", "--model", str(unserved), "--initial-peers", local_swarm.initial_peers[0],
                 "--gen-length", "8", "--steps", "4", "--block-length", "8", "--threads", "1")
    assert_one_line(result, EXIT_NOT_SERVED, "no online server holds blocks 0:4")


# ----- generate finds the swarm as every command does (issue 46) -------------------------------------------------
def generate_json(*args: str, env: dict) -> dict:
    result = run("generate", "Hi", "--gen-length", "8", "--steps", "8", "--block-length", "8", "--threads", "1",
                 "--json", "--quiet", *args, env=env)
    assert result.exit_code == 0 and result.stderr == "", result.output
    return json.loads(result.stdout)


def test_generate_takes_its_peers_from_the_environment_and_the_bootstrap_file(local_swarm, tiny_model_path, tmp_path):
    """It ran the model in its own process whatever $SWARM_INITIAL_PEERS said, and its output did not say where."""
    from swarm.frontend.local import DiffusionLM

    model = ["--model", str(tiny_model_path)]
    bootstrap_file = tmp_path / "bootstrap.txt"
    bootstrap_file.write_text(local_swarm.initial_peers[0] + "\n")
    nowhere = str(tmp_path / "no-bootstrap-peers.txt")
    expected = DiffusionLM.from_pretrained(tiny_model_path).generate("Hi", gen_length=8, steps=8, block_length=8)
    for env in ({ENV_PEERS: local_swarm.initial_peers[0], ENV_BOOTSTRAP_FILE: nowhere},
                {ENV_PEERS: "", ENV_BOOTSTRAP_FILE: str(bootstrap_file)}):
        record = generate_json(*model, env=env)
        hops = record["ran"].split(" -> ")
        assert record["ran"] != "local" and hops == record["info"]["route"], record["ran"]
        assert all(re.fullmatch(r"\w{8}\[\d+:\d+\]", hop) for hop in hops), hops
        assert record["token_ids"] == expected.token_ids and record["info"]["settings"]["seed"] == 0
    local = generate_json(*model, "--local", env={ENV_PEERS: local_swarm.initial_peers[0]})
    assert local["ran"] == "local" and "route" not in local["info"] and local["token_ids"] == expected.token_ids
    conflict = run("generate", "Hi", "--local", "--initial-peers", local_swarm.initial_peers[0])
    assert conflict.exit_code == EXIT_USAGE and "--local runs the model in this process" in conflict.stderr


def test_every_command_that_generates_takes_max_new_tokens():
    """``--max-new-tokens`` is ``--gen-length`` (as ``max_new_tokens=`` in Python): it answered "No such option"."""
    from swarm.benchmark.commands import main as benchmark_group
    from swarm.eval.__main__ import main as eval_cli
    from swarm.eval.text_quality import main as text_quality_cli

    commands_with_length = [commands()["generate"], eval_cli, text_quality_cli]
    commands_with_length += [command for command in benchmark_group.commands.values()
                             if any(param.name == "gen_length" for param in command.params)]
    assert len(commands_with_length) >= 6
    for command in commands_with_length:
        option = next(param for param in command.params if param.name == "gen_length")
        assert {"--gen-length", "--max-new-tokens"} <= set(option.opts), (command.name, option.opts)
    scripts = [path for folder in ("swarm", "benchmarks", "examples") for path in Path(folder).rglob("*.py")]
    declared_elsewhere = [str(path) for path in scripts if '"--gen-length"' in path.read_text()]
    assert declared_elsewhere == ["swarm/diffusion/config.py"], "declare the flag once: gen_length_option"


# ----- a halted swarm ------------------------------------------------------------------------------------------
SETTINGS = dict(gen_length=64, steps=64, block_length=64, seed=1)


@pytest.fixture(scope="module")
def halted(local_swarm, swarm_peer, tmp_path_factory):
    """A model served by one server that trusts a governance key, halted by that key; the operator's DHT peer (the
    file's ``swarm_peer``: a decision's signature, not the peer that stores it, is what a reader checks)."""
    from swarm.dht.schema import default_prefix
    from swarm.governance.records import HALT, publish

    root = tmp_path_factory.mktemp("halted")
    key = generate_private_key(root / "gov.key")
    path = make_checkpoint(root / "halted-model", tiny_config(), seed=8)
    server = local_swarm.start_server(str(path), "0:4", "--compute-threads", "1",
                                      "--governance-key", public_key_text(key))
    try:
        assert publish(swarm_peer, key, default_prefix(path), HALT, "incident 7", timestamp=time.time() - 1)
        yield path, key, swarm_peer
    finally:
        stop_all(local_swarm, [server])  # its own prefix


def test_generate_on_a_halted_swarm_exits_5_with_the_reason_and_a_date(local_swarm, halted):
    path, key, _ = halted
    result = run("generate", "Hi", "--model", str(path), "--initial-peers", local_swarm.initial_peers[0],
                 "--gen-length", "8", "--steps", "8", "--threads", "1",
                 env={"SWARM_GOVERNANCE_KEYS": public_key_text(key)})
    line = assert_one_line(result, EXIT_HALTED, "halted by governance", "incident 7", "before step 0")
    assert re.search(r"signed \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", line), line
    assert result.stdout == "", "no text is printed for a halted generation"


def test_governance_status_prints_a_date_and_exits_5(local_swarm, halted):
    path, key, _ = halted
    from swarm.dht.schema import default_prefix

    result = run("governance", "status", "--governance-key", public_key_text(key), "--dht-prefix",
                 default_prefix(path), "--initial-peers", local_swarm.initial_peers[0])
    assert result.exit_code == EXIT_HALTED, result.output
    assert re.search(r"HALTED: last halt #\d+ signed \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(incident 7\)",
                     result.stdout), result.stdout


@pytest.fixture(scope="module")
def halted_api(local_swarm, halted):
    pytest.importorskip("uvicorn", reason="the API needs fastapi and uvicorn")
    from swarm.api import GenerationEngine, create_app
    from swarm.client import DistributedDiffusionLM
    from tests.test_api import serve

    path, key, operator = halted
    lm = DistributedDiffusionLM.from_pretrained(path, dht=operator, governance_keys=(public_key_text(key),))
    try:
        engine = GenerationEngine(lm, "halted-model")
        with serve(create_app(engine)) as url:
            yield url
    finally:
        lm.shutdown()


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("stream", [False, True])
def test_the_api_answers_a_halt_with_503_swarm_halted(halted_api, stream):
    """It once answered 200 with empty text and finish_reason 'length'."""
    for route, prompt in (("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": [
            {"role": "user", "content": "Hi"}]})):
        status, body = post(f"{halted_api}/v1/{route}", {"model": "halted-model", "max_tokens": 8, "stream": stream,
                                                         **prompt})
        assert status == 503, body
        error = body["error"]
        assert (error["type"], error["code"]) == ("service_unavailable", "swarm_halted")
        assert "incident 7" in error["message"] and " UTC" in error["message"]


def test_the_api_health_shows_the_halt(halted_api):
    try:
        urllib.request.urlopen(f"{halted_api}/health", timeout=60)
        raise AssertionError("a halted swarm answered healthy")
    except urllib.error.HTTPError as error:
        assert error.code == 503
        report = json.loads(error.read())
    assert report["status"] == "degraded" and report["halted"]["reason"] == "incident 7"
    assert report["halted"]["signed_at"].endswith(" UTC")


def test_a_halt_during_a_stream_ends_it_with_an_error_event(local_swarm, halted, tmp_path):
    """Resume, start a stream, halt after its first event: the stream ends with OpenAI's error event and no
    final text or [DONE]."""
    pytest.importorskip("uvicorn", reason="the API needs fastapi and uvicorn")
    from swarm.api import GenerationEngine, create_app
    from swarm.client import DistributedDiffusionLM
    from swarm.dht.schema import default_prefix
    from swarm.governance.records import HALT, RESUME, publish
    from tests.test_api import serve

    path, key, operator = halted
    prefix = default_prefix(path)
    assert publish(operator, key, prefix, RESUME, "drill over", timestamp=time.time())
    try:
        with DistributedDiffusionLM.from_pretrained(path, dht=operator, governance_keys=(public_key_text(key),)) as lm:
            with serve(create_app(GenerationEngine(lm, "halted-model"))) as url:
                body = {"model": "halted-model", "prompt": "Hi", "max_tokens": SETTINGS["gen_length"],
                        "steps": SETTINGS["steps"], "block_length": SETTINGS["block_length"], "stream": True}
                events = []
                with open_stream(f"{url}/v1/completions", body) as response:
                    for raw in response:
                        line = raw.decode().strip()
                        if not line.startswith("data: "):
                            continue
                        events.append(line[len("data: "):])
                        if len(events) == 1:
                            assert publish(operator, key, prefix, HALT, "incident 8", timestamp=time.time())
    finally:
        assert publish(operator, key, prefix, HALT, "incident 7", timestamp=time.time())  # as the fixture left it
    last = json.loads(events[-1])
    assert last["error"]["code"] == "swarm_halted" and "incident 8" in last["error"]["message"]
    assert "[DONE]" not in events and 1 < len(events) < SETTINGS["steps"] + 1


def open_stream(url: str, body: dict, wait_s: float = 20.0):
    """The stream's response once the server has seen the resume too (it polls the records every 2 s, and
    refuses steps until then: the API answers those with 503 swarm_halted)."""
    deadline = time.monotonic() + wait_s
    while True:
        request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(request, timeout=120)
        except urllib.error.HTTPError as error:
            assert error.code == 503 and time.monotonic() < deadline, error.read()
            time.sleep(0.5)


def test_utc_time_is_readable():
    assert utc_time(0) == "1970-01-01 00:00:00 UTC"


@pytest.mark.swarm  # real processes
def test_cpu_of_counts_an_orphans_cpu_and_names_its_kind():
    """benchmarks/cpu_of.py (the suite's CPU figures in docs/TESTING.md): a grandchild whose parent exits at once is
    reaped by it and its CPU counted (``/usr/bin/time`` would lose it), and ``--by-kind`` names it by its module."""
    burn = "sum(range(20_000_000)); time.sleep(1)"
    orphaning = (f"import subprocess, sys; subprocess.Popen([sys.executable, '-m', 'timeit', '-n', '1', '-r', '1', "
                 f"'-s', 'import time', {burn!r}])")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "benchmarks/cpu_of.py", "--by-kind", sys.executable, "-c", orphaning],
                          capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr
    total = re.search(r"cpu_of: [\d.]+ s wall, .* ([\d.]+) CPU s", done.stderr)
    assert total and float(total.group(1)) >= 0.2, done.stderr  # the orphan's sum, not just the parent's start
    timeit = re.search(r"([\d.]+) CPU s +1 processes +python -m timeit", done.stderr)
    assert timeit and float(timeit.group(1)) >= 0.2, done.stderr


@pytest.mark.swarm  # real processes
def test_xdist_timeline_reports_each_files_span_per_worker(tmp_path):
    """benchmarks/xdist_timeline.py (the per-worker spans in docs/TESTING.md): recorded by the workers, reported."""
    (tmp_path / "test_a.py").write_text("import time\ndef test_a():\n    time.sleep(0.3)\n")
    (tmp_path / "test_b.py").write_text("def test_b():\n    pass\n")
    root = Path(__file__).resolve().parents[1]
    # only the plugins the run needs (xdist and the timeline's): each of its three processes would otherwise import
    # every installed pytest plugin (hypothesis, ...), 3.1 instead of 1.2 CPU s
    env = dict(os.environ, PYTHONPATH=str(root / "benchmarks"), XDIST_TIMELINE_DIR=str(tmp_path / "timeline"),
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "xdist", "-n", "2", "--dist", "loadfile", "-p",
                          "xdist_timeline", "-p", "no:cacheprovider", "test_a.py", "test_b.py"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(path.name for path in (tmp_path / "timeline").iterdir()) == ["gw0.tsv", "gw1.tsv"]
    shown = subprocess.run([sys.executable, "benchmarks/xdist_timeline.py", str(tmp_path / "timeline"), "--over",
                            "0.2"], capture_output=True, text=True, timeout=60, cwd=root)
    assert shown.returncode == 0 and shown.stdout.count("last test ended at") == 2, shown.stdout + shown.stderr
    assert "test_a.py" in shown.stdout and "test_b.py" not in shown.stdout  # only spans over --over
