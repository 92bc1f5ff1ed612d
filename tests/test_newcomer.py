"""The second hour of a new user (issue 56): every command the README and docs name works after the README's install
or names the extra it needs; errors that name the likely fix; the tokenizer called as a transformers one.

Item 2 (the tiers' time and memory) is tested by the tier machinery in conftest.py; item 4 (one view of liveness)
in test_health.py and test_spot_checks.py; the README's snippets in test_readme.py.
"""
from __future__ import annotations

import configparser
import importlib
import re
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from swarm.cli.options import EXIT_USAGE, SwarmCommand, as_cli_error
from swarm.utils.extras import extra_providing, install_hint

ROOT = Path(__file__).resolve().parents[1]
SOME_PEER = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # never dialed
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# ----- item 1: one install line, and the extra a command needs named in one line -----------------------------------
NOT_CLICK = {"swarm.testing.netlab"}  # the NAT lab's own tool (root, network namespaces): argparse, tested in test_nat


def commands_named() -> set[tuple[str, str]]:
    """``(module, first word after it)`` for every ``python -m swarm.X`` the README and docs name."""
    found = set()
    for path in DOCUMENTS:
        for module, word in re.findall(r"python -m (swarm(?:\.\w+)*)(?: ([a-z][a-z-]*))?", path.read_text()):
            found.add((module, word))
    return found


def command_of(module: str) -> click.Command:
    """The click command ``python -m module`` runs (a package's ``__main__``, else the module itself)."""
    try:
        loaded = importlib.import_module(f"{module}.__main__")
    except ModuleNotFoundError:
        loaded = importlib.import_module(module)
    return loaded.main


def test_every_command_the_readme_and_docs_name_answers_help():
    # Imported and asked for --help in this process: a module that moved, or that imports a package the README's
    # install does not give (FastAPI and uvicorn were an extra: `python -m swarm.api` failed), fails here.
    named = commands_named()
    assert {"swarm.api", "swarm.health", "swarm.server", "swarm.generate"} <= {module for module, _ in named}
    runner = CliRunner()
    for module, word in sorted(named):
        if module in NOT_CLICK:
            continue
        command = command_of(module)
        args = [word, "--help"] if isinstance(command, click.Group) and word in command.commands else ["--help"]
        result = runner.invoke(command, args)
        assert result.exit_code == 0, (module, args, result.output, result.exception)


def test_the_api_and_the_pages_need_only_the_readmes_install():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options"]["install_requires"].splitlines()
    required = {line.split(">")[0].split("=")[0].strip() for line in lines}
    assert {"fastapi", "uvicorn", "pydantic", "starlette"} <= required, "swarm.api and the pages after the install"


def test_a_missing_optional_package_is_one_line_naming_its_extra_with_exit_2(monkeypatch):
    # What `python -m swarm.api` or `health --serve` met without uvicorn, and the demo's plot without matplotlib: a
    # module an extra provides is an install line and exit 2, never "internal error ... (a bug)".
    @click.command(cls=SwarmCommand)
    def needs_plot():
        importlib.import_module("matplotlib")  # as swarm.improve.demo's plot imports it

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without the plot extra raises
    result = CliRunner().invoke(needs_plot, [])
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.output.strip() == (
        "Error: this needs the package 'matplotlib', which the plot extra installs: " + install_hint("plot"))
    assert "bug" not in result.output
    failure = as_cli_error(ModuleNotFoundError("No module named 'uvicorn'", name="uvicorn"))
    assert failure is not None and failure.exit_code == EXIT_USAGE and 'pip install -e ".[api]"' in failure.message
    assert as_cli_error(ModuleNotFoundError("No module named 'nothing_of_ours'", name="nothing_of_ours")) is None


def test_the_extras_are_the_ones_setup_cfg_declares():
    assert extra_providing("matplotlib") == "plot"
    assert extra_providing("gensim") == "train", "the test extra repeats gensim; the advice is the train extra"
    assert extra_providing("datasets") == "data"
    assert extra_providing("torch") is None, "a required package is no extra's"


def test_the_serve_flag_names_the_missing_package_with_its_install_line(monkeypatch):
    from swarm.health.__main__ import main as health_cli

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # checked before the port is taken or the swarm joined
    result = CliRunner().invoke(health_cli, ["--serve", "--port", "0", "--initial-peers", SOME_PEER])
    assert result.exit_code == EXIT_USAGE, result.output
    assert "'uvicorn'" in result.output and 'pip install -e ".[api]"' in result.output


def test_the_demo_says_what_it_wrote_and_the_plots_install_line(tmp_path, monkeypatch):
    from swarm.improve.demo import Row, write_outputs

    rows = [Row(0, {}, {}, {}, "-", None, 0.0, False)]
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    said = write_outputs(tmp_path, rows)
    assert (tmp_path / "improve_demo.md").exists() and (tmp_path / "improve_demo.json").exists()
    assert not (tmp_path / "improve_demo.png").exists()
    assert str(tmp_path / "improve_demo.md") in said and "no plot" in said and install_hint("plot") in said


def test_every_install_hint_is_spelled_one_way():
    # The README installs with `pip install -e .` and `pip install -e ".[test]"`; a hint spelled otherwise
    # (`pip install fastapi uvicorn`, `pip install 'diffusion-swarm[api]'`, `.[plot]` unquoted) was a second way.
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = set(config["options.extras_require"])
    allowed = re.compile(r'pip install -e (\.|"\.\[(\w+)\]")(?=[\s`)\'";]|$)')
    outside = {"pip install torch==", "pip install openai", "pip install --no-deps torch", "pip install -c docker/"}
    defined = ROOT / "swarm" / "utils" / "extras.py"  # where the spelling is written once, as a template
    sources = DOCUMENTS + [path for path in sorted((ROOT / "swarm").rglob("*.py")) if path != defined]
    for path in sources:
        for line in path.read_text().splitlines():
            for start in [match.start() for match in re.finditer("pip install ", line)]:
                rest = line[start:]
                if any(rest.startswith(other) for other in outside):
                    continue
                match = allowed.match(rest)
                assert match, f"{path.relative_to(ROOT)}: {line.strip()}"
                assert match.group(2) in (None, *extras), f"{path.relative_to(ROOT)} names no extra: {line.strip()}"


# ----- item 3: errors that name the likely fix, input checked before anything starts --------------------------------
TRUNCATED_PEER = SOME_PEER[:-1]  # a character lost in a copy: no peer id at all
BAD_INPUT = [("--initial-peers", TRUNCATED_PEER, "is not a peer id"), ("--gen-length", "0", "gen_length must be"),
             ("--temperature", "11", "temperature must be"), ("--cfg-scale", "-1", "cfg_scale must be")]
# What a check before anything starts must not need: the model's weights, the swarm client, the DHT.
HEAVY_MODULES = ("hivemind", "swarm.models.loading", "swarm.client.model", "swarm.frontend.local", "swarm.dht.node")


def every_command() -> list[tuple[str, click.Command]]:
    """Each command and subcommand the README and docs name, with the words that run it."""
    found = []
    for module in sorted({module for module, _ in commands_named()} - NOT_CLICK):
        command = command_of(module)
        if isinstance(command, click.Group):
            found += [(f"{module} {name}", sub) for name, sub in sorted(command.commands.items())]
        else:
            found.append((module, command))
    return found


def required_arguments(command: click.Command, folder: Path, tested: str) -> list[str]:
    """Values for the command's required parameters but ``tested``, of the right kind, so that the bad one is what
    is refused."""
    args: list[str] = []
    for param in command.params:
        if not param.required or tested in param.opts:
            continue
        if "--initial-peers" in param.opts:
            value = SOME_PEER
        elif isinstance(param.type, click.Choice):
            value = str(param.type.choices[0])
        elif isinstance(param.type, click.Path):
            value = str(folder if not param.type.file_okay else folder / "file")
        elif isinstance(param.type, (click.types.IntParamType, click.types.FloatParamType)):
            value = "1"
        else:
            value = "x"
        args += [value] if isinstance(param, click.Argument) else [param.opts[0], value]
    return args


def test_input_known_to_be_wrong_is_refused_before_anything_loads_or_joins(tmp_path, monkeypatch):
    # The class, not the two examples of the issue: every command the docs name, every option whose value can be
    # checked alone (a peer id, a generation setting), is refused in one line, exit 2, with the model, the client and
    # the DHT out of reach (their import fails here), as `generate --gen-length 0` took 6 s and a bad peer id 11 s.
    (tmp_path / "file").write_text("{}")
    for name in HEAVY_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    checked = set()
    runner = CliRunner()
    for words, command in every_command():
        flags = {opt for param in command.params for opt in param.opts}
        for flag, value, fragment in BAD_INPUT:
            if flag not in flags:
                continue
            result = runner.invoke(command, [*required_arguments(command, tmp_path, flag), flag, value])
            assert result.exit_code == EXIT_USAGE, (words, flag, result.output, result.exception)
            said = result.output.strip().splitlines()
            if "is not in the range" in said[-1]:  # click's own bounds (a benchmark's --gen-length 1..512)
                continue
            assert len(said) == 1 and fragment in said[0], (words, flag, result.output)
            checked.add((words, flag))
    assert {("swarm.generate", "--gen-length"), ("swarm.generate", "--initial-peers"),
            ("swarm.generate", "--cfg-scale"), ("swarm.api", "--initial-peers"), ("swarm.health", "--initial-peers")
            } <= checked


def test_an_unknown_model_name_lists_the_embedded_models_and_close_matches_before_publishers():
    # Through a swarm, `--model defualt` was answered with advice on trusted publishers alone; `--local` listed the
    # embedded names. The resolver here is the swarm client's own (no trusted publisher: refused before the network).
    from swarm.dht.config import NetworkConfig
    from swarm.models.loading import resolve_model
    from swarm.weights.source import SwarmWeights
    from swarm.weights.trust import PublisherTrust

    weights = SwarmWeights(NetworkConfig(initial_peers=[SOME_PEER]), trust=PublisherTrust())
    with pytest.raises(ValueError) as through_swarm:
        resolve_model("defualt", resolvers=[weights.resolve])
    with pytest.raises(FileNotFoundError) as local:
        resolve_model("defualt")
    for error in (through_swarm.value, local.value):
        message = str(error)
        assert message.startswith("model 'defualt' is no embedded model (did you mean 'default'? embedded: "), message
    swarm_message = str(through_swarm.value)
    assert swarm_message.index("did you mean") < swarm_message.index("publishers you trust")
    assert "did you mean" not in str(pytest.raises(FileNotFoundError, resolve_model, "zzzzzz").value)


def test_generate_through_a_swarm_names_the_model_a_typo_meant(local_swarm):
    from swarm.generate import main as generate_cli

    result = CliRunner().invoke(generate_cli, ["Hi", "--model", "defualt", "--initial-peers",
                                               local_swarm.initial_peers[0]])
    assert result.exit_code == EXIT_USAGE, result.output
    assert "did you mean 'default'?" in result.output and len(result.output.strip().splitlines()) == 1


def test_the_model_a_swarm_serves_is_read_from_its_servers_records(remote_lm):
    from swarm.dht.served import choose_served, served_blocks

    served = served_blocks(remote_lm.dht, {"tiny": (remote_lm.prefix, 4), "absent": ("nobody-serves-this", 4)})
    assert served == {"tiny": {0, 1, 2, 3}, "absent": set()}
    sizes = {"tiny": 4, "absent": 4}
    assert choose_served(served, sizes, preferred="absent") == "tiny", "a model nobody serves is never chosen"
    assert choose_served({"a": {0, 1}, "b": {0, 1, 2, 3}}, {"a": 4, "b": 4}, preferred="a") == "b", "the complete one"
    assert choose_served({"a": {0, 1, 2, 3}, "b": {0, 1, 2, 3}}, {"a": 4, "b": 4}, preferred="b") == "b"
    assert choose_served({"a": set()}, {"a": 4}, preferred="a") is None


def test_improve_says_which_model_it_used_and_fails_in_one_line_without_a_traceback(local_swarm, tmp_path):
    # Against the README's servers, `swarm.improve` took `addition` unsaid, failed with "no online server holds blocks
    # 0:4", then printed two asyncio "Task was destroyed but it is pending!" tracebacks. This swarm serves no
    # embedded model: the command says what it fell back to, and its error is its last line. Its own process,
    # forked from the swarm's fork server (torch and hivemind imported: 2-2.5 CPU s less than an exec'd one), which
    # exits as the interpreter does, so asyncio's messages at exit are still printed where they would be.
    from swarm.governance.keys import generate_private_key

    key = tmp_path / "publisher.key"
    generate_private_key(key)
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "response": "2"}\n')
    code, output = local_swarm.run_command(
        ["-m", "swarm.improve", "--task", "addition", "--data", str(data), "--name", "t", "--key", str(key),
         "--workdir", str(tmp_path / "work"), "--initial-peers", local_swarm.initial_peers[0], "--rounds", "1",
         "--log-level", "WARNING"], cwd=str(ROOT), timeout=240)
    lines = [line for line in output.splitlines() if line.strip()]  # nothing on stdout: stderr's lines alone
    assert code != 0 and lines[-1].startswith("Error: no online server holds blocks"), output
    assert lines[0].startswith("model: addition (no server of an embedded model was found"), output
    assert "Traceback" not in output and "Task was destroyed" not in output, output


# ----- item 5: the tokenizer called as a transformers one; --json's text --------------------------------------------
def test_the_tokenizer_is_called_as_a_transformers_tokenizer(local_lm):
    import torch

    from swarm.models.tokenizer import ByteTokenizer

    for tokenizer in (local_lm.tokenizer, ByteTokenizer()):
        plain = tokenizer("The government said")
        assert plain["input_ids"] == tokenizer.encode("The government said") and set(plain["attention_mask"]) == {1}
        encoding = tokenizer("The government said", return_tensors="pt")
        assert encoding.input_ids.dtype == torch.long and encoding.input_ids.shape == (1, len(plain["input_ids"]))
        assert tokenizer.decode(encoding.input_ids[0]) == "The government said"
        batch = tokenizer(["a b", "The government said"], return_tensors="pt", padding=True)
        short = len(tokenizer.encode("a b"))
        assert batch.attention_mask[0].tolist() == [1] * short + [0] * (batch.input_ids.shape[1] - short)
        assert batch.input_ids[0, short:].eq(tokenizer.pad_token_id).all()
        assert tokenizer.batch_decode(batch.input_ids) == ["a b", "The government said"]
        with pytest.raises(ValueError, match="padding=True"):
            tokenizer(["a b", "The government said"], return_tensors="pt")
        with pytest.raises(ValueError, match="return_tensors"):
            tokenizer("a", return_tensors="np")
    # The README's `lm.logits(input_ids)`: the ids come from the tokenizer, and a batch with its mask scores each row
    # as that row alone does.
    encoding = local_lm.tokenizer("The government said", return_tensors="pt")
    alone = local_lm.logits(encoding["input_ids"])
    assert alone.shape[:2] == encoding.input_ids.shape
    batch = local_lm.tokenizer(["The government said", "a"], return_tensors="pt", padding=True)
    assert torch.equal(local_lm.logits(**batch)[0], alone[0])


def test_json_says_text_is_the_continuation_and_holds_the_prompt(tiny_model_path):
    import json

    from swarm.generate import main as generate_cli

    runner = CliRunner()
    args = ["The", "--model", str(tiny_model_path), "--local", "--gen-length", "8", "--steps", "8", "--seed", "1"]
    plain = runner.invoke(generate_cli, [*args, "--quiet"])
    record = json.loads(runner.invoke(generate_cli, [*args, "--json"]).stdout)
    assert plain.stdout.rstrip("\n") == record["prompt"] + record["text"]
    assert "continuation alone" in runner.invoke(generate_cli, ["--help"]).output
