"""The Docker image, checked without a Docker daemon (issue 20, item 9).

What can be checked here is checked for real: the entrypoint runs under bash as an unprivileged user, with a
``python`` on PATH that records its command line instead of starting the swarm, and the real click parsers of
the commands parse what it would run; the Dockerfile's pins are checked against setup.cfg.
"""
from __future__ import annotations

import configparser
import fnmatch
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
CONSTRAINTS = ROOT / "docker" / "constraints.txt"
NOBODY = 65534

# A stand-in for the image's python: it appends its arguments (NUL-separated, one command per line) to $RECORD
# and exits with $FAKE_EXIT (default 0).
RECORDER = """#!/bin/sh
printf '%s\\0' "$@" >> "$RECORD"
printf '\\n' >> "$RECORD"
exit "${FAKE_EXIT:-0}"
"""


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", "\n".join(line for line in DOCKERFILE.splitlines()
                                             if not line.lstrip().startswith("#")))
    return [tuple(line.strip().split(None, 1)) for line in text.splitlines() if line.strip()]


def instructions(name: str) -> list[str]:
    return [args for instruction, args in dockerfile_instructions() if instruction == name]


def pins() -> dict[str, str]:
    lines = [line for line in CONSTRAINTS.read_text().splitlines() if line and not line.startswith("#")]
    parsed = [line.split("==") for line in lines]
    assert all(len(parts) == 2 for parts in parsed), "every constraint is NAME==VERSION"
    return {canonicalize_name(name): version for name, version in parsed}


def setup_requirements(extra: str) -> list[Requirement]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options"]["install_requires"].splitlines() + config["options.extras_require"][extra].splitlines()
    return [Requirement(line) for line in lines if line.strip()]


# ----- the Dockerfile -------------------------------------------------------------------------------------------
def test_the_base_image_is_pinned_to_a_python_the_project_supports():
    default = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE, re.M).group(1)
    match = re.fullmatch(r"python:(\d+\.\d+\.\d+)-slim-bookworm(@sha256:[0-9a-f]{64})?", default)
    assert match, f"base image {default!r} is not pinned to a full version"
    assert instructions("FROM") == ["${PYTHON_IMAGE}"]
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert SpecifierSet(config["options"]["python_requires"]).contains(match.group(1))


def test_every_package_the_image_installs_is_pinned_and_agrees_with_setup_cfg():
    pinned = pins()
    runs = " ; ".join(instructions("RUN"))
    installs = [command for command in re.split(r"&&|;", runs) if "pip install" in command]
    assert installs, "the image installs the project with pip"
    for command in installs:
        words = shlex.split(command)
        named = [w for w in words[words.index("install") + 1:] if not w.startswith("-") and "://" not in w
                 and w not in ("docker/constraints.txt",)]
        for word in named:
            if word.startswith("."):  # the project itself: its dependencies under the constraints
                assert "-c" in words and words[words.index("-c") + 1] == "docker/constraints.txt", command
                extras = re.fullmatch(r"\.\[(.*)\]", word).group(1).split(",")
                assert extras == ["api"], "the extras the entrypoint's commands need"
            else:  # a package installed on its own: pinned, and to the same version as the constraints
                requirement = Requirement(word)
                assert str(requirement.specifier).startswith("=="), command
                assert str(requirement.specifier)[2:] == pinned[canonicalize_name(requirement.name)]
    for requirement in setup_requirements("api"):
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{name} is not pinned in docker/constraints.txt"
        assert requirement.specifier.contains(pinned[name], prereleases=True), \
            f"{name}=={pinned[name]} does not satisfy setup.cfg's {requirement}"
    apt = re.findall(r"apt-get install[^;&]*", runs)
    for command in apt:
        packages = [w for w in command.split()[2:] if not w.startswith("-")]
        assert packages and all("=" in p for p in packages), f"unpinned apt packages: {command}"


def test_the_image_has_an_init_a_healthcheck_and_a_writable_data_dir():
    assert instructions("ENTRYPOINT") == ['["tini", "--", "swarm-entrypoint"]']
    assert "tini=" in DOCKERFILE, "tini comes from Debian, pinned"
    healthcheck, = instructions("HEALTHCHECK")
    assert healthcheck.endswith('CMD ["swarm-entrypoint", "healthcheck"]')
    assert not instructions("USER"), "the entrypoint starts as root to fix /data's owner, then drops to uid 1000"
    assert "useradd --create-home --uid 1000 swarm" in DOCKERFILE


def test_what_the_dockerfile_copies_exists_and_is_not_ignored():
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for args in instructions("COPY"):
        for source in args.split()[:-1]:
            assert (ROOT / source).exists(), source
            assert not any(fnmatch.fnmatch(source, pattern) or source.startswith(pattern.rstrip("/") + "/")
                           for pattern in ignored), f"{source} is excluded by .dockerignore"


# ----- the entrypoint ---------------------------------------------------------------------------------------------
def test_the_entrypoint_is_valid_bash():
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)


@pytest.fixture
def entrypoint():
    """Run the entrypoint as an unprivileged user (nobody, when the tests run as root), its ``python`` recorded;
    returns (exit code, stderr, the recorded command lines). The user runs a copy of the script under /tmp: a
    checkout in a private directory (mode 700, as ``mktemp -d`` makes) is not readable by it."""
    if os.geteuid() == 0 and not shutil.which("setpriv"):
        pytest.skip("running the entrypoint as another user needs setpriv (util-linux)")
    with tempfile.TemporaryDirectory() as scratch:  # under /tmp: the other user must reach it
        root = Path(scratch)
        root.chmod(0o755)
        bin_dir, data, record, script = root / "bin", root / "data", root / "record", root / "entrypoint.sh"
        bin_dir.mkdir(mode=0o755)
        data.mkdir()
        (bin_dir / "python").write_text(RECORDER)
        (bin_dir / "python").chmod(0o755)
        record.touch(mode=0o666)
        record.chmod(0o666)

        def run(*args: str, env: dict | None = None, data_mode: int = 0o777) -> tuple[int, str, list[list[str]]]:
            data.chmod(data_mode)
            shutil.copyfile(ENTRYPOINT, script)
            script.chmod(0o755)
            record.write_text("")
            environment = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD": str(record), "SWARM_DATA_DIR": str(data),
                           **(env or {})}
            user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if os.geteuid() == 0 else []
            done = subprocess.run([*user, "bash", str(script), *args], env=environment, capture_output=True,
                                  text=True, timeout=60)
            commands = [line.split("\0")[:-1] for line in record.read_text().splitlines()]
            return done.returncode, done.stderr, commands

        yield run


SERVER_ENV = {
    "SWARM_MODEL": "/models/LLaDA-8B-Instruct", "SWARM_BLOCKS": "0:8", "SWARM_PUBLIC_NAME": "alice",
    "SWARM_DHT_PREFIX": "llada", "SWARM_THROUGHPUT": "12.5", "SWARM_THREADS": "3",
    "SWARM_HOST_MADDRS": "/ip4/0.0.0.0/tcp/31337 /ip6/::/tcp/31337",
    "SWARM_ANNOUNCE_MADDRS": "/ip4/203.0.113.7/tcp/31337", "SWARM_IDENTITY_PATH": "/data/peer.key",
}


def parse(command, argv: list[str]) -> dict:
    """The parameters the real click command makes of ``argv`` (types and ranges checked, nothing run)."""
    return command.make_context("swarm", list(argv)).params


def test_every_server_variable_becomes_a_real_flag_of_swarm_server(entrypoint):
    from swarm.server.__main__ import main as server

    code, stderr, commands = entrypoint(env=SERVER_ENV)
    assert code == 0, stderr
    (argv,) = commands
    assert argv[:2] == ["-m", "swarm.server"]
    params = parse(server, argv[2:])
    assert (params["model"], params["blocks"], params["public_name"], params["dht_prefix"]) == \
        ("/models/LLaDA-8B-Instruct", (0, 8), "alice", "llada")  # --blocks is parsed to a span
    assert (params["throughput"], params["compute_threads"], params["identity_path"]) == ("12.5", 3, "/data/peer.key")
    assert params["host_maddrs"] == ("/ip4/0.0.0.0/tcp/31337", "/ip6/::/tcp/31337")
    assert params["announce_maddrs"] == ("/ip4/203.0.113.7/tcp/31337",)
    documented = set(re.findall(r"^#\s+(SWARM_[A-Z_]+)\s", ENTRYPOINT.read_text(), re.M))
    assert documented == set(SERVER_ENV) | {"SWARM_INITIAL_PEERS", "SWARM_NUM_BLOCKS"}
    operations = (ROOT / "docs" / "OPERATIONS.md").read_text()
    assert all(f"`{name}`" in operations for name in documented | {"SWARM_DATA_DIR"}), "documented in OPERATIONS.md"
    # SWARM_NUM_BLOCKS, and options after the command, which win.
    code, stderr, commands = entrypoint("server", "--public-name", "bob", env={"SWARM_NUM_BLOCKS": "4"})
    params = parse(server, commands[0][2:])
    assert code == 0 and params["num_blocks"] == 4 and params["public_name"] == "bob"
    assert params["identity_path"].endswith("/data/identity.key")
    assert params["host_maddrs"] == ("/ip4/0.0.0.0/tcp/31337",)


def test_the_other_commands_reach_their_parsers(entrypoint):
    from swarm.api.__main__ import main as api
    from swarm.dht.__main__ import main as dht
    from swarm.health.__main__ import main as health

    for name, command, args in (("api", api, ["--local", "--port", "8000"]), ("dht", dht, ["--host-maddrs",
                                "/ip4/0.0.0.0/tcp/31337"]), ("health", health, ["--json"])):
        code, stderr, commands = entrypoint(name, *args)
        assert code == 0, stderr
        assert commands == [["-m", f"swarm.{name}", *args]]
        parse(command, args)


def test_the_healthcheck_maps_swarm_health_to_docker_exit_codes(entrypoint):
    from swarm.health.__main__ import main as health

    code, stderr, commands = entrypoint("healthcheck")
    assert code == 0 and commands == [], "no initial peers: nothing to check"
    peers = {"SWARM_INITIAL_PEERS": "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW", "SWARM_MODEL": "default",
             "SWARM_DHT_PREFIX": "default"}
    for health_exit, docker_exit in ((0, 0), (1, 1), (3, 1), (2, 1)):  # Docker reserves 2: never returned
        code, stderr, commands = entrypoint("healthcheck", env={**peers, "FAKE_EXIT": str(health_exit)})
        assert code == docker_exit, (health_exit, stderr)
    assert commands == [["-m", "swarm.health", "--model", "default", "--dht-prefix", "default"]]
    parse(health, commands[0][2:])


def test_a_data_dir_the_user_cannot_write_is_one_clear_line(entrypoint):
    if os.geteuid() != 0:
        pytest.skip("the data directory is the tests' own user's: it stays writable")
    code, stderr, commands = entrypoint("server", data_mode=stat.S_IRWXU)  # root's, as a bind-mounted host dir
    assert code == 2 and commands == []
    (line,) = stderr.strip().splitlines()
    assert line.startswith("Error: ") and f"is not writable by uid {NOBODY}" in line


def test_the_entrypoint_runs_from_a_checkout_in_a_private_directory(entrypoint, tmp_path, monkeypatch):
    """Issue 56: run as root from a clone inside a ``mktemp -d`` folder (mode 700), the unprivileged user could not
    read the checkout's script. pytest's ``tmp_path`` is such a folder."""
    if os.geteuid() != 0:
        pytest.skip("only root's private folder is closed to the user the entrypoint runs as")
    private = tmp_path / "clone"
    private.mkdir(mode=0o700)
    tmp_path.chmod(0o700)
    monkeypatch.setattr(sys.modules[__name__], "ENTRYPOINT", shutil.copy(ENTRYPOINT, private / "entrypoint.sh"))
    code, stderr, commands = entrypoint("dht")
    assert code == 0, stderr
    assert commands == [["-m", "swarm.dht"]]


def test_as_root_the_entrypoint_gives_data_to_the_user_and_runs_as_it():
    """The image starts as root: a root-owned bind mount (and a root-owned identity key in it) become the swarm
    user's, and the command runs as that user. This machine has no ``swarm`` user: the same script runs with
    ``nobody`` instead."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv")
    with tempfile.TemporaryDirectory() as scratch:  # under /tmp: nobody must reach it
        Path(scratch).chmod(0o755)
        check_root_start(Path(scratch))


def check_root_start(tmp_path: Path) -> None:
    script = tmp_path / "entrypoint.sh"
    script.write_text(ENTRYPOINT.read_text().replace("SWARM_USER=swarm\n", "SWARM_USER=nobody\n", 1))
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    (data / "identity.key").write_text("key")
    (data / "identity.key").chmod(0o600)
    probe = f'id -u; touch "{data}/created"; cat "{data}/identity.key"'
    done = subprocess.run(["bash", str(script), "sh", "-c", probe], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "SWARM_DATA_DIR": str(data)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(NOBODY), "key"]
    assert {path.stat().st_uid for path in (data, data / "identity.key", data / "created")} == {NOBODY}
