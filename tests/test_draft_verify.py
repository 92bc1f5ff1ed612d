"""Draft-and-verify decoding (``draft_steps``, issue 38): the tokens of the sequential run, fewer round trips.

Each call evaluates the exact state and states drafted from the last verified state's own logits; a draft is
kept only when it equals the exact step. These tests check the tokens against the sequential sampler for many
seeds and every remasking strategy (greedy and sampled, with threshold decoding and guidance), on the tiny
model, the embedded default model and through the swarm (client head, head server, a server killed mid-run);
that skipping the check changes the tokens (so the check is what keeps them); and that bad values are refused.
"""
from __future__ import annotations

import signal

import pytest
import torch

from swarm.client import DistributedDiffusionLM
from swarm.diffusion.config import MAX_DRAFT_STEPS, GenerationConfig, GenerationLimits, SettingError
from swarm.diffusion.remasking import STRATEGIES
from swarm.diffusion.sampler import DiffusionSampler
from swarm.frontend.local import DiffusionLM
from swarm.frontend.scale import plan_scale
from tests.conftest import stop_all, wait_all, wait_seen

SHORT = dict(gen_length=16, steps=16, block_length=8)
VARIANTS = {  # name: settings over SHORT; every strategy runs greedy and sampled besides these
    "threshold": dict(steps=8, threshold=0.3),
    "cfg": dict(cfg_scale=1.5),
    "two per step": dict(steps=8),
}


def assert_same_run(sequential, drafted) -> None:
    """Same final state, same steps; drafts made fewer (or as many) calls and every call made progress."""
    assert torch.equal(drafted.sequence, sequential.sequence)
    assert drafted.token_ids == sequential.token_ids
    assert drafted.steps == sequential.steps
    assert drafted.denoiser_calls <= sequential.denoiser_calls
    assert all(1 <= w.accepted <= w.evaluated for w in drafted.windows)


# ----- locally ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("remasking", list(STRATEGIES))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafts_give_the_sequential_tokens_for_many_seeds(local_lm, remasking, temperature):
    saved = 0
    for seed in range(4):  # draft_steps 1, 2, 3 and 4, each once per strategy and temperature
        settings = dict(SHORT, remasking=remasking, temperature=temperature, seed=seed)
        sequential = local_lm.generate(f"draft {seed}", **settings)
        drafted = local_lm.generate(f"draft {seed}", draft_steps=1 + seed % 4, **settings)
        assert_same_run(sequential, drafted)
        saved += sequential.denoiser_calls - drafted.denoiser_calls
    assert saved > 0, "no draft was ever accepted: the comparison would prove nothing"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("remasking", list(STRATEGIES))
def test_drafts_with_threshold_guidance_and_several_tokens_per_step(local_lm, variant, remasking):
    for seed in range(2):
        settings = dict(SHORT, **VARIANTS[variant], remasking=remasking, temperature=0.6 * seed, seed=seed)
        assert_same_run(local_lm.generate("variant", **settings), local_lm.generate("variant", draft_steps=3,
                                                                                     **settings))


@pytest.fixture(scope="module")
def default_lm() -> DiffusionLM:
    return DiffusionLM.from_pretrained("default")


@pytest.mark.parametrize("remasking, temperature, seed", [("low_confidence", 0.0, 0), ("entropy", 0.5, 1),
                                                          ("margin", 0.5, 2)])
def test_the_default_model_keeps_its_tokens_in_fewer_calls(default_lm, remasking, temperature, seed):
    settings = dict(gen_length=16, remasking=remasking, temperature=temperature, seed=seed)
    sequential = default_lm.generate("The government said", **settings)
    drafted = default_lm.generate("The government said", draft_steps=3, **settings)
    assert_same_run(sequential, drafted)
    assert drafted.denoiser_calls < sequential.denoiser_calls


def test_drafts_compose_experts_as_the_sequential_run_does(default_lm):
    """Each verified row's logits are composed with the expert's answers for that row, as a sequential step's."""
    settings = dict(gen_length=16, remasking="low_confidence", temperature=0.5, seed=3, experts={"code": 0.7})
    sequential = default_lm.generate("def add(a, b):", **settings)
    drafted = default_lm.generate("def add(a, b):", draft_steps=3, **settings)
    assert_same_run(sequential, drafted)
    assert drafted.denoiser_calls < sequential.denoiser_calls


class UncheckedDrafts(DiffusionSampler):
    """The skipped check: every evaluated draft is taken as exact. Not offered to users; here to show that the
    check is what keeps the tokens."""

    def _accepted(self, states, chain) -> int:
        return len(states)


def test_skipping_the_check_changes_the_tokens(local_lm):
    def run(sampler_class, config: GenerationConfig, prompt: list[int]) -> torch.Tensor:
        sampler = sampler_class(lambda tokens, context: local_lm.logits(tokens), config,
                                local_lm.config.mask_token_id)
        return list(sampler.iterate(prompt))[-1].tokens

    differs = 0
    for seed in range(6):
        config = GenerationConfig(**SHORT, remasking="low_confidence", temperature=0.5, seed=seed)
        prompt = local_lm.encode_prompt(f"unchecked {seed}")
        sequential = run(DiffusionSampler, config, prompt)
        assert torch.equal(run(DiffusionSampler, config.replace(draft_steps=3), prompt), sequential)
        differs += not torch.equal(run(UncheckedDrafts, config.replace(draft_steps=3), prompt), sequential)
    assert differs > 0, "unchecked drafts gave the sequential tokens for every seed: the test proves nothing"


def test_a_call_verifies_the_exact_state_and_its_drafts(local_lm):
    """The first call has nothing to draft from; later calls evaluate at most draft_steps + 1 states, and the
    sampler's statistics count them."""
    result = local_lm.generate("stats", draft_steps=2, **SHORT)
    assert result.windows[0].evaluated == 1
    assert max(w.evaluated for w in result.windows) <= 3
    assert result.states_evaluated == sum(w.evaluated for w in result.windows)
    assert result.denoiser_calls == len(result.windows)


# ----- bounds ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, message", [
    (dict(draft_steps=-1), f"draft_steps must be 0..{MAX_DRAFT_STEPS}"),
    (dict(draft_steps=MAX_DRAFT_STEPS + 1), f"draft_steps must be 0..{MAX_DRAFT_STEPS}"),
    (dict(draft_steps=2.5), "draft_steps must be an integer"),
    (dict(draft_steps=True), "draft_steps must be an integer"),
    (dict(draft_steps=2, parallel_window=2), "set one of them"),
    (dict(draft_steps=2, staleness=1), "stateless denoiser"),
    (dict(draft_steps=2, cache="dual"), "stateless denoiser"),
])
def test_bad_draft_settings_are_refused_with_their_bounds(settings, message):
    with pytest.raises(SettingError, match=message) as refused:
        GenerationConfig(**settings)
    assert refused.value.param == "draft_steps"


def test_the_command_line_offers_and_bounds_draft_steps(tiny_model_path):
    from click.testing import CliRunner

    from swarm.generate import main as generate_cli

    result = CliRunner().invoke(generate_cli, ["hi", "--model", str(tiny_model_path), "--draft-steps", "40"])
    assert result.exit_code == 2 and f"draft_steps must be 0..{MAX_DRAFT_STEPS}" in result.output


def test_the_http_api_refuses_bad_draft_steps_before_any_compute(tiny_model_path):
    pytest.importorskip("fastapi", reason="the API needs fastapi")
    from swarm.api import load_engine

    engine = load_engine(str(tiny_model_path), local=True)
    for value, message in ((MAX_DRAFT_STEPS + 1, f"draft_steps must be 0..{MAX_DRAFT_STEPS}"),
                           (1.5, "draft_steps must be an integer")):
        with pytest.raises(ValueError, match=message):
            engine.check_settings({"draft_steps": value})
    engine.check_settings({"draft_steps": 3})


def test_drafts_count_against_the_memory_budget(local_lm):
    """A call holds draft_steps + 1 states: too many for the budget is refused, naming draft_steps."""
    config = GenerationConfig(gen_length=64, steps=64, block_length=32, draft_steps=7)
    starved = GenerationLimits(512, local_lm.limits.bytes_per_token, memory_budget=1)
    with pytest.raises(SettingError, match=r"would hold 536 sequence positions") as refused:
        starved.check(config, prompt_length=3)
    assert refused.value.param == "draft_steps"
    assert starved.window_room(config, prompt_length=3) == 7  # 512 positions hold 7 states of 67


def test_corrector_steps_refuse_drafts(local_lm):
    with pytest.raises(ValueError, match="draft_steps=0"):
        local_lm.generate("x", experts={}, corrector_steps=1, draft_steps=2, **SHORT)


# ----- the scale ------------------------------------------------------------------------------------------
def test_the_scale_drafts_for_confidence_orders_through_the_swarm():
    assert plan_scale("auto", {"remasking": "low_confidence"}, remote=True).settings == {"draft_steps": 3}
    assert plan_scale("auto", {}, remote=True).settings == {"draft_steps": 3}  # the model's own order
    assert plan_scale("max", {"remasking": "entropy"}, remote=True).settings == {"draft_steps": 7}
    assert plan_scale("auto", {"remasking": "random"}, remote=True).settings == {"parallel_window": 4}
    for settings in ({"draft_steps": 0}, {"parallel_window": 1}, {"staleness": 1}, {"cache": "dual"}):
        assert plan_scale("auto", settings, remote=True).settings == {}, settings
    assert plan_scale("auto", {}, remote=False).settings == {}
    assert plan_scale("auto", {}, remote=True, correctors=1).settings == {}


def test_drafts_the_scale_chose_shrink_to_the_budget(remote_lm):
    prompt = remote_lm.encode_prompt("hi")
    assert remote_lm.check_request(prompt, gen_length=448).generation.draft_steps == 3
    small = GenerationLimits(remote_lm.limits.max_positions, remote_lm.limits.bytes_per_token,
                             memory_budget=1400 * remote_lm.limits.bytes_per_token)
    remote_lm.limits, saved = small, remote_lm.limits
    try:
        assert remote_lm.check_request(prompt, gen_length=448).generation.draft_steps == 2  # 3 x 451 fit
        with pytest.raises(ValueError, match="draft_steps"):  # asked for by the caller: refused
            remote_lm.check_request(prompt, gen_length=448, draft_steps=3)
    finally:
        remote_lm.limits = saved


# ----- through the swarm --------------------------------------------------------------------------------
@pytest.mark.parametrize("settings", [
    dict(remasking="low_confidence", temperature=0.0, seed=3),
    dict(remasking="margin", temperature=0.7, seed=4, cfg_scale=1.0),
    dict(remasking="entropy", temperature=0.7, seed=5, steps=8, threshold=0.3),
    dict(remasking="random", temperature=0.7, seed=6),
], ids=["greedy", "cfg", "threshold", "random"])
def test_drafts_through_the_swarm_give_the_local_tokens(remote_lm, local_lm, settings):
    settings = dict(SHORT, **settings)
    sequential = local_lm.generate("swarm drafts", **settings)
    drafted = remote_lm.generate("swarm drafts", draft_steps=3, **settings)
    assert_same_run(sequential, drafted)
    auto = remote_lm.generate("swarm drafts", **settings)  # scale="auto" batches states by itself
    assert auto.token_ids == sequential.token_ids and auto.denoiser_calls < sequential.denoiser_calls


def test_drafts_are_pushed_from_server_to_server(remote_lm, local_lm, monkeypatch):
    """With push, each verification call is one pushed pass through the chain of servers, none redone hop by hop."""
    from tests.test_latency_hiding import assert_pushed, pushed_passes

    settings = dict(SHORT, remasking="low_confidence", temperature=0.5, seed=8, draft_steps=3)
    remote_lm.client_config.push = True
    try:
        result, pushed, hop_by_hop = pushed_passes(remote_lm, lambda: remote_lm.generate("pushed", **settings),
                                                   monkeypatch)
    finally:
        remote_lm.client_config.push = False
    assert result.token_ids == local_lm.generate("pushed", **settings).token_ids
    assert max(window.evaluated for window in result.windows) > 1
    assert_pushed(pushed, hop_by_hop, result.denoiser_calls, staleness=0)


def head_client(swarm_peer, tiny_model_path, prefix: str) -> DistributedDiffusionLM:
    """A client of the servers under ``prefix``, through the module's DHT peer (its peer id is not the point)."""
    return DistributedDiffusionLM.from_pretrained(tiny_model_path, dht=swarm_peer, dht_prefix=prefix,
                                                  request_timeout=20, spot_check_fraction=0)  # checks load a head


def test_drafts_with_the_head_on_the_server_and_after_it_is_killed(local_swarm, tiny_model_path, local_lm,
                                                                   swarm_peer):
    """The head server answers each row's predictions (no logits reach the client): drafts come from them, for every
    strategy, threshold decoding and guidance. Then SIGKILL of the route's only server after the third step: the
    generation goes on over a replica without the head (the client's head then scores its hidden states) with the
    local tokens. Its own servers and prefix (the kill would take a shared head server from every test after it); one
    replica of every block, since a server start is ~1 CPU s and the hops' count is not the point; one pair of servers
    for both halves (a head server of its own for the first half was one start more)."""
    prefix = "draft-loss"
    servers = [local_swarm.start_server(str(tiny_model_path), span, "--dht-prefix", prefix, "--compute-threads", "1",
                                        *extra, name=f"draft-loss-{role}", wait=False)
               for role, span, extra in (("head", "0:4", ("--head", "--throughput", "1e9")), ("replica", "0:4", ()))]
    wait_all(local_swarm, servers)
    head = servers[0]
    settings = dict(SHORT, remasking="low_confidence", temperature=0.7, seed=9, draft_steps=3)
    try:
        with head_client(swarm_peer, tiny_model_path, prefix) as lm:
            wait_seen(lm, servers)
            assert [hop.peer_id for hop in lm.show_route()] == [head.peer_id]
            cases = [dict(remasking=remasking, temperature=0.6 * (seed % 2), seed=seed)
                     for seed, remasking in enumerate(STRATEGIES)]
            cases += [dict(VARIANTS["threshold"], temperature=0.6, seed=7),
                      dict(VARIANTS["cfg"], temperature=0.6, seed=8)]
            for case in cases:
                case_settings = dict(SHORT, **case)
                assert_same_run(local_lm.generate("head", **case_settings),
                                lm.generate("head", draft_steps=3, **case_settings))
            assert lm._head is None, "the client scored logits itself although the head server answered"
            result = None
            for chunk in lm.generate_stream("failover drafts", **settings):
                if chunk.done:
                    result = chunk.result
                elif chunk.step >= 2 and head.alive:
                    local_swarm.terminate(head, signal.SIGKILL)
        expected = local_lm.generate("failover drafts", **settings)
        assert_same_run(local_lm.generate("failover drafts", **dict(settings, draft_steps=0)), result)
        assert result.token_ids == expected.token_ids
        assert any(event["peer_id"] == head.peer_id for event in result.info["failovers"])
    finally:
        stop_all(local_swarm, [server for server in servers if server.alive])  # their own prefix
