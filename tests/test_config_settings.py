"""Server and client settings come from one declaration each (issue 34, items 4 and 5).

``ServerConfig`` and ``ClientConfig`` declare every setting once (default, help, bounds: ``swarm.utils.settings``);
the command-line options and the Python-side validation are made from that declaration. These tests enumerate
the declarations, so a setting that the command line or the validation misses fails here, and one test adds a
setting to a subclass to show that it reaches both without any other edit.
"""
from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from swarm.cli.options import EXIT_USAGE, config_options, pop_config_kwargs
from swarm.client.config import ClientConfig
from swarm.dht.config import NetworkConfig
from swarm.dht.peers import NoInitialPeers
from swarm.generate import main as generate_cli
from swarm.server.__main__ import main as server_cli
from swarm.server.config import ServerConfig
from swarm.utils.errors import EXIT_UNREACHABLE, SwarmError
from swarm.utils.settings import SettingError, SettingField, declared, setting, settings_of
from tests.source_trees import parse_source
from tests.test_cli import no_default_peers  # noqa: F401 (a fixture: no peers from the environment or a file)

ROOT = Path(__file__).resolve().parents[1]
SERVER = [field for field in settings_of(ServerConfig) if field.spec.cli]
CLIENT = [field for field in settings_of(ClientConfig) if field.spec.cli]


def options_of(command: click.Command) -> dict[str, click.Parameter]:
    return {param.name: param for param in command.params}


def past_bound(field: SettingField) -> Any:
    """A value just outside the declared bounds (below the lower one, or above the upper one)."""
    spec = field.spec
    if spec.high is not None and not isinstance(spec.high, str):
        return spec.high + (1 if field.kind is int else spec.high * 0.5 + 1.0)
    return spec.low - 1 if field.kind is int else (spec.low if spec.low_open else spec.low - 1.0)


# ----- the command line --------------------------------------------------------------------------------------
@pytest.mark.parametrize("command, fields, prefix", [(server_cli, SERVER, ""),
                                                     (generate_cli, CLIENT, "Through a swarm: ")],
                         ids=["server", "generate"])
def test_every_declared_setting_is_an_option_with_its_help_default_and_flag(command, fields, prefix):
    params = options_of(command)
    for field in fields:
        assert field.name in params, f"{field.name} has no option"
        param = params[field.name]
        assert field.flag in param.opts, (field.name, param.opts)
        assert param.help.startswith(prefix) and field.spec.help[1:] in param.help, field.name
        expected = field.default if not field.repeated else ()
        assert param.default == expected or (param.default is None and field.default is None), field.name


def test_the_server_options_keep_their_names():
    """Flag names users have in scripts (issue 34: keep every existing flag)."""
    flags = {flag for param in server_cli.params for flag in param.opts + param.secondary_opts}
    for flag in ("--model", "--blocks", "--num-blocks", "--expert", "--public-name", "--throughput", "--dht-prefix",
                 "--device", "--dtype", "--quant", "--head", "--max-batch-tokens", "--max-concurrent-requests",
                 "--max-queued-tokens", "--peer-share", "--max-pending-pushes", "--push-memory-mb", "--push-timeout",
                 "--request-timeout", "--max-unfinished-streams", "--receive-timeout", "--receive-rate-mb",
                 "--known-peer-reserve", "--cache-memory-mb", "--cache-max-entries", "--cache-ttl", "--update-period",
                 "--wire-dtype", "--backward", "--no-backward", "--adapter-memory-mb", "--serve-adapter", "--threads",
                 "--compute-threads", "--governance-key", "--governance-stale-after", "--log-level",
                 "--initial-peers", "--host-maddrs", "--announce-maddrs", "--identity-path", "--use-relay",
                 "--no-relay", "--use-auto-relay"):
        assert flag in flags, flag
    generate_flags = {flag for param in generate_cli.params for flag in param.opts}
    assert {"--push", "--allow-approximate", "--head", "--dtype", "--initial-peers"} <= generate_flags


@pytest.mark.parametrize("field", [f for f in SERVER if f.spec.low is not None], ids=lambda f: f.name)
def test_the_server_command_refuses_each_bound_before_loading_anything(field):
    result = CliRunner().invoke(server_cli, [field.flag, str(past_bound(field))])
    assert result.exit_code == EXIT_USAGE and "is not in the range" in result.output, result.output


@pytest.mark.parametrize("cls", [ServerConfig, ClientConfig])
def test_python_callers_get_the_same_bounds(cls):
    """Each declared bound refuses a value past it from Python too, naming ``Class.field``; NaN and text too."""
    for field in settings_of(cls):
        if field.spec.low is None:
            continue
        for value in (past_bound(field), "3", *([math.nan, math.inf] if field.kind is float else [])):
            with pytest.raises(SettingError) as refused:
                cls(**{field.name: value})
            assert f"{cls.__name__}.{field.name}" in str(refused.value) and refused.value.param == field.name


def test_types_and_choices_are_checked_for_python_callers():
    with pytest.raises(SettingError, match=r"ServerConfig.blocks must be None or \(start, end\)"):
        ServerConfig(blocks=(4, 2))
    with pytest.raises(SettingError, match="unknown ServerConfig.wire_dtype 'float8'; choose one of auto"):
        ServerConfig(wire_dtype="float8")
    with pytest.raises(SettingError, match="ServerConfig.head must be true or false"):
        ServerConfig(head="yes")
    with pytest.raises(SettingError, match="--throughput"):
        ServerConfig(throughput="fast")
    with pytest.raises(SettingError, match="unknown ClientConfig.head 'server'"):
        ClientConfig(head="server")
    with pytest.raises(SettingError, match="ClientConfig.max_retries must be an integer"):
        ClientConfig(max_retries=1.5)
    assert ServerConfig(blocks=(0, 4), throughput="12.5").blocks == (0, 4)
    assert ClientConfig(audit_log=Path("audit.jsonl")).audit_log == Path("audit.jsonl")  # a path may be a Path
    with pytest.raises(SettingError, match="ClientConfig.dht_prefix must be a string"):
        ClientConfig(dht_prefix=Path("model"))


def test_the_declared_wire_choices_are_the_wires():
    from swarm.wire.encoding import WIRE_CHOICES

    for cls in (ServerConfig, ClientConfig):
        assert declared(cls, "wire_dtype").spec.choices == WIRE_CHOICES


def test_a_setting_error_is_a_value_error_and_a_swarm_error_with_exit_code_2():
    with pytest.raises(ValueError) as refused:
        ClientConfig(request_timeout=0)
    assert isinstance(refused.value, SwarmError) and refused.value.exit_code == EXIT_USAGE


# ----- one declaration: a new setting ------------------------------------------------------------------------
@dataclasses.dataclass
class WithKnob(ServerConfig):
    """What adding a server flag looks like: one declared field (the server would then read ``config.knob``)."""

    knob: int = setting(3, "A new server setting.", low=1, high=9)


def test_a_new_server_setting_reaches_validation_and_the_command_line():
    with pytest.raises(SettingError, match=r"WithKnob.knob must be 1\.\.9, got 12"):
        WithKnob(knob=12)

    @click.command()
    @config_options(WithKnob)
    def command(**options):
        click.echo(repr(WithKnob(**pop_config_kwargs(options, WithKnob)).knob))

    assert "A new server setting." in CliRunner().invoke(command, ["--help"]).output
    assert CliRunner().invoke(command, ["--knob", "4"]).output.strip() == "4"
    assert "is not in the range 1<=x<=9" in CliRunner().invoke(command, ["--knob", "0"]).output


# ----- from_pretrained and peers -----------------------------------------------------------------------------
def test_from_pretrained_never_changes_the_callers_config(local_swarm, tiny_model_path):
    from swarm.client.model import DistributedDiffusionLM

    config = ClientConfig(network=NetworkConfig(initial_peers=list(local_swarm.initial_peers), client_mode=True))
    before = dataclasses.asdict(config)
    with DistributedDiffusionLM.from_pretrained(tiny_model_path, config=config, request_timeout=7.0,
                                                push=True) as lm:
        assert lm.client_config.request_timeout == 7.0 and lm.client_config.push is True
        assert lm.client_config is not config
    assert dataclasses.asdict(config) == before
    with pytest.raises(TypeError, match="unknown client option.*'request_timout'"):
        DistributedDiffusionLM.from_pretrained(tiny_model_path, config=config, request_timout=7.0)
    with pytest.raises(SettingError, match="ClientConfig.request_timeout"):
        DistributedDiffusionLM.from_pretrained(tiny_model_path, config=config, request_timeout=-1)
    assert dataclasses.asdict(config) == before


@pytest.mark.usefixtures("no_default_peers")
def test_no_peers_is_one_line_at_once(tiny_model_path):
    """Issue 37 item 4: it waited 7-11 s and said "no online server holds blocks 0:16"."""
    from swarm.client.model import DistributedDiffusionLM

    with pytest.raises(NoInitialPeers) as refused:
        DistributedDiffusionLM.from_pretrained(tiny_model_path)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("no initial peers: pass initial_peers=")
    assert "$SWARM_INITIAL_PEERS" in message and "swarm.DiffusionLM" in message
    assert refused.value.exit_code == EXIT_UNREACHABLE


def test_one_string_of_peers_is_a_list_of_peers(local_swarm, tiny_model_path):
    """Issue 37 item 5: ``initial_peers="<address>"`` failed with "'/' is not a peer's multiaddr"."""
    from swarm.client.model import DistributedDiffusionLM

    assert NetworkConfig(initial_peers="/ip4/1.2.3.4/tcp/1/p2p/A, /ip4/1.2.3.4/tcp/2/p2p/B").initial_peers == [
        "/ip4/1.2.3.4/tcp/1/p2p/A", "/ip4/1.2.3.4/tcp/2/p2p/B"]
    with DistributedDiffusionLM.from_pretrained(tiny_model_path, initial_peers=local_swarm.initial_peers[0]) as lm:
        assert lm.generate("hi", gen_length=4, steps=4, block_length=4).steps == 4


# ----- one root exception ------------------------------------------------------------------------------------
def exception_classes() -> dict[str, list[tuple[str, list[str]]]]:
    """Every class of the package whose name says it is an error: {name: [(module path, base names)]}."""
    found: dict[str, list[tuple[str, list[str]]]] = {}
    for path in sorted((ROOT / "swarm").rglob("*.py")):
        for node in ast.walk(parse_source(path)):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(base, ast.Name) and (base.id.endswith(("Error", "Exception")) or base.id in (
                        "Halted", "SwarmError", "Unavailable", "APIError", "RetriesExhausted")) for base in node.bases):
                bases = [base.id for base in node.bases if isinstance(base, ast.Name)]
                found.setdefault(node.name, []).append((str(path.relative_to(ROOT)), bases))
    return found


def test_every_exception_of_the_project_derives_from_swarm_error():
    import importlib

    classes = exception_classes()
    assert [where for where, _ in classes["SwarmHalted"]] == ["swarm/governance/guard.py"], "one SwarmHalted"
    duplicates = {name: places for name, places in classes.items() if len(places) > 1}
    assert not duplicates, duplicates
    for name, [(where, bases)] in classes.items():
        if "ClickException" in bases or "CLIError" in bases:
            continue  # click's own error type (the command line's one-line errors)
        module = importlib.import_module(where[:-3].replace("/", "."))
        assert issubclass(getattr(module, name), SwarmError), f"{where}: {name} does not derive from SwarmError"


def test_the_exit_code_table_imports_only_the_root_exception():
    tree = parse_source(ROOT / "swarm" / "cli" / "options.py")
    imported: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("swarm"):
            imported += [f"{node.module}.{alias.name}" for alias in node.names]
    error_names = [name for name in imported if name.rsplit(".", 1)[1].endswith(("Error", "Halted", "Exception"))]
    assert error_names == ["swarm.utils.errors.SwarmError"], error_names
