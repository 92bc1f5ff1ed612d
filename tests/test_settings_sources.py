"""Generation settings come from one source (issue 18): ``GenerationConfig`` and ``GenerationRequest``.

Every test enumerates the declared fields, so a new setting that the command line, the HTTP API or the
documented argument lists miss fails here; and one test adds a setting to a subclass to show that the CLI
and the API pick it up without being edited.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any

import click
import pytest
from click.testing import CliRunner

from swarm.cli.options import generation_options, pop_generation_kwargs, require_no_options_left
from swarm.diffusion.config import GenerationConfig, SettingError, SettingField, setting, settings_of
from swarm.frontend.lm import BaseDiffusionLM, GenerationRequest
from swarm.frontend.local import DiffusionLM
from swarm.frontend.scale import plan_scale
from swarm.generate import main as generate_cli

pytest.importorskip("fastapi", reason="the API schema needs pydantic and fastapi")
from swarm.api.schemas import ChatCompletionRequest, CompletionRequest, settings_model  # noqa: E402

USING = Path(__file__).resolve().parents[1] / "docs" / "USING.md"  # the README links it for the details
SETTINGS = settings_of(GenerationConfig) + settings_of(GenerationRequest)


def other_value(field: SettingField) -> Any:
    """A value of the field's type different from its default (never validated here, only carried)."""
    if field.kind is bool:
        return not field.default
    if field.spec.choices:
        return next(choice for choice in field.spec.choices if choice != field.default)
    if field.kind is int:
        return (field.default or 0) + 1
    if field.kind is float:
        return (field.default or 0.0) + 0.5
    return "auto"  # experts


def as_argv(field: SettingField, value: Any) -> list[str]:
    flag = "--" + field.name.replace("_", "-")
    if field.kind is bool:
        return [flag if value else f"--no-{flag[2:]}"]
    return [flag, str(value)]


class Captured(Exception):
    """Raised by the spy once it has the arguments: the generation itself is not what these tests check."""


@pytest.fixture
def generate_calls(monkeypatch) -> list[dict[str, Any]]:
    """The keyword arguments each ``generate_stream`` call receives (a spy on the real method, which it stops)."""
    calls: list[dict[str, Any]] = []

    def spy(self, prompt, **kwargs):
        calls.append(kwargs)
        raise Captured()
        yield  # a generator, like the real method

    monkeypatch.setattr(BaseDiffusionLM, "generate_stream", spy)
    # The command's early check (before loading the model) would refuse the carried values, which need not fit
    # together; it has tests of its own (test_cli.py).
    monkeypatch.setattr("swarm.generate.check_before_loading", lambda model, peers, settings: None)
    return calls


# ----- the command line ------------------------------------------------------------------------------------
def test_every_setting_has_a_flag_that_reaches_generate(tiny_model_path, generate_calls):
    offered = [field for field in SETTINGS if field.spec.cli]
    assert {field.name for field in SETTINGS} - {field.name for field in offered} == {"progress"}
    flags = {param.name for param in generate_cli.params}
    assert {field.name for field in offered} <= flags, "a setting without a command-line flag"
    values = {field.name: other_value(field) for field in offered}
    argv = ["hi", "--model", str(tiny_model_path)] + [arg for f in offered for arg in as_argv(f, values[f.name])]
    result = CliRunner().invoke(generate_cli, argv)
    assert isinstance(result.exception, Captured), result.output
    assert generate_calls == [values]


def test_flags_left_at_their_default_leave_the_library_defaults(tiny_model_path, generate_calls):
    """Only the flags given reach ``generate``, so the scale may still choose a window, as for Python callers."""
    result = CliRunner().invoke(generate_cli, ["hi", "--model", str(tiny_model_path), "--remasking", "random"])
    assert isinstance(result.exception, Captured), result.output
    assert generate_calls == [{"remasking": "random"}]


def test_the_experts_flag_parses_weights_and_refuses_nonsense(tiny_model_path, generate_calls):
    base = ["hi", "--model", str(tiny_model_path)]
    assert isinstance(CliRunner().invoke(generate_cli, base + ["--experts", "code=0.5,addition=1"]).exception, Captured)
    assert generate_calls[-1] == {"experts": {"code": 0.5, "addition": 1.0}}
    result = CliRunner().invoke(generate_cli, base + ["--experts", "code"])
    assert result.exit_code == 2 and "NAME=WEIGHT" in result.output


def test_a_flag_wired_to_nothing_is_refused_not_ignored():
    @click.command()
    @click.option("--orphan", default=None, help="A flag that no setting declares.")
    @generation_options
    def command(**options):
        pop_generation_kwargs(options)
        require_no_options_left(options)

    result = CliRunner().invoke(command, ["--seed", "3"])
    assert result.exit_code == 2 and "option orphan reaches no argument" in result.output, result.output


def test_the_command_line_refuses_out_of_range_values_with_the_same_message(tiny_model_path):
    result = CliRunner().invoke(generate_cli, ["hi", "--model", str(tiny_model_path), "--staleness", "9"])
    assert result.exit_code == 2 and "staleness must be 0..8" in result.output


# ----- the HTTP API ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_every_setting_is_a_request_field_with_its_help(model):
    offered = [field for field in SETTINGS if field.spec.api]
    assert {field.name for field in SETTINGS} - {field.name for field in offered} == {"chat", "progress", "adapter"}
    for field in offered:
        assert field.name in model.model_fields, f"{field.name} is missing from {model.__name__}"
        assert model.model_fields[field.name].description == field.describe()


def test_every_request_field_reaches_generate():
    offered = [field for field in SETTINGS if field.spec.api]
    values = {field.name: other_value(field) for field in offered}
    request = CompletionRequest(model="m", prompt="hi", **values)
    assert {**request.generation_kwargs(), **request.request_kwargs()} == values


def test_integers_and_booleans_are_strict_in_the_api():
    for bad in ({"seed": "8"}, {"staleness": 1.5}, {"stop_at_eos": "no"}, {"corrector_steps": "1"}):
        with pytest.raises(ValueError):
            CompletionRequest(model="m", prompt="hi", **bad)


# ----- the documentation -----------------------------------------------------------------------------------
def test_the_generate_docstring_names_every_setting():
    documented = set(re.findall(r"``(\w+)``", BaseDiffusionLM.generate_stream.__doc__))
    missing = [field.name for field in SETTINGS if field.name not in documented]
    assert not missing, f"generate_stream's docstring does not document {missing}"


def test_the_docs_list_every_generate_argument():
    text = USING.read_text()
    start = text.index("`generate` arguments:")
    paragraph = text[start:text.index("\n\n", start)]
    listed = set(re.findall(r"`(\w+)`", paragraph))
    missing = [field.name for field in SETTINGS if field.name not in listed]
    assert not missing, f"docs/USING.md's list of generate arguments lacks {missing}"


# ----- one declaration -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WithKnob(GenerationConfig):
    """What adding a sampler setting looks like: one declared field (the sampler would then read it)."""

    knob: int = setting(2, "A new sampler setting.", low=0, high=5)


def test_a_new_setting_reaches_validation_the_cli_and_the_api():
    fields = settings_of(WithKnob)
    with pytest.raises(SettingError, match=r"knob must be 0\.\.5, got 9"):
        WithKnob(knob=9)

    @click.command()
    @lambda command: generation_options(command, fields)
    def command(**options):
        click.echo(repr(pop_generation_kwargs(options, keys=[field.name for field in fields])))

    assert "--knob INTEGER" in CliRunner().invoke(command, ["--help"]).output
    assert CliRunner().invoke(command, ["--knob", "4"]).output.strip() == "{'knob': 4}"
    model = settings_model(fields, "WithKnobSettings")
    assert model(knob=4).knob == 4 and model.model_fields["knob"].description == "A new sampler setting. Range: 0..5."


@pytest.mark.parametrize("field", [f for f in SETTINGS if f.spec.low is not None], ids=lambda f: f.name)
def test_each_declared_bound_is_enforced(field):
    """One past the declared upper bound (or, with none, below the lower one: the lengths are at least 1) is
    refused, naming the setting (cache_refresh's bound is ``steps``)."""
    high = GenerationConfig().steps if isinstance(field.spec.high, str) else field.spec.high
    if high is None:
        value = field.spec.low - 1
    else:
        value = high + 1 if field.kind is int else high * 1.5
    with pytest.raises(SettingError) as refused:
        if field in settings_of(GenerationConfig):
            GenerationConfig(**{field.name: value})
        else:
            GenerationRequest(**{field.name: value}).check()
    assert refused.value.param == field.name and field.name in str(refused.value)


def test_unknown_arguments_are_named(tiny_model_path):
    lm = DiffusionLM.from_pretrained(tiny_model_path)
    with pytest.raises(TypeError, match="unknown generation argument.*temprature"):
        lm.generate("hi", temprature=0.5)


def test_plan_scale_leaves_the_settings_alone():
    settings = MappingProxyType({"remasking": "random"})  # any write would raise
    plan = plan_scale("max", settings, remote=True)
    assert dict(settings) == {"remasking": "random"}
    assert plan.settings == {"parallel_window": 8} and plan.experts == "auto"
    assert set(plan.filled) == {"parallel_window", "experts"}
    assert plan_scale("max", settings, remote=True, experts={"code": 1.0}).experts is None  # the caller's stay


@pytest.mark.swarm
def test_the_new_api_fields_reach_the_sampler_and_are_bounded(tiny_model_path):
    """``stop_at_eos``, ``expert_tau`` and ``corrector_steps`` over HTTP: the Python API's tokens, its refusals."""
    pytest.importorskip("uvicorn", reason="the API needs fastapi and uvicorn")
    from swarm.api import GenerationEngine, create_app
    from tests.test_api import http, serve

    lm = DiffusionLM.from_pretrained(tiny_model_path)
    settings = {"steps": 8, "block_length": 4, "stop_at_eos": False, "corrector_steps": 1, "expert_tau": 5.0}
    expected = lm.generate("hi", gen_length=8, **settings)
    with serve(create_app(GenerationEngine(lm, "tiny"))) as url:
        status, body = http(f"{url}/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 8, **settings})
        assert status == 200 and body["choices"][0]["text"] == expected.text, body
        status, body = http(f"{url}/v1/completions", {"model": "tiny", "prompt": "hi", "corrector_steps": 1000})
        assert status == 400 and "corrector_steps must be 0..8" in body["error"]["message"]
        assert body["error"]["param"] == "corrector_steps"
        raw = b'{"model": "tiny", "prompt": "hi", "expert_tau": NaN}'
        status, body = http(f"{url}/v1/completions", raw=raw)
        assert status == 400 and "expert_tau must be a finite number" in body["error"]["message"]
