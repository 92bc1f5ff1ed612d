"""Experts: the composition's closed form, local and swarm composition, compatibility, failover, RPC checks."""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import PeerID

from swarm.dht.compatibility import CompatibilityTag, IncompatibleExpertError
from swarm.dht.identity import Identity
from swarm.dht.node import NetworkConfig, start_dht
from swarm.dht.schema import (
    ExpertRecord,
    ServerState,
    declare_experts,
    default_prefix,
    read_expert_domains,
    read_expert_records,
)
from swarm.diffusion.composition import (
    Composition,
    InProcessExpert,
    auto_experts,
    compose,
    expert_weights,
    summarize,
    validate_tau,
)
from swarm.diffusion.config import MAX_EXPERT_TOP_K, GenerationConfig
from swarm.diffusion.experts import block_log_probs, expert_scores
from swarm.diffusion.pipeline import DenoiserCalls
from swarm.diffusion.sparse import SparseScores
from swarm.frontend.local import DiffusionLM
from swarm.models.tokenizer import ByteTokenizer
from swarm.wire.encoding import collect_response, expert_query_message
from swarm.wire.messages import ErrorCode, ExpertQuery, RemoteError
from swarm.wire.services import SpanService
from tests.conftest import make_checkpoint, raw_answer, tiny_config, wait_until

SETTINGS = dict(gen_length=16, steps=8, block_length=8)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a busy machine: torch's thread pool spinning costs 100x more than it saves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----- the closed form -------------------------------------------------------------------------------------
def test_composition_equals_its_closed_form_with_clipping():
    base = torch.tensor([0.7, 0.2, 0.1]).log()
    expert = torch.tensor([1e-6, 0.5, 0.5 - 1e-6]).log()
    weight, tau = 0.5, 10.0
    composed = compose(base[None] + 3.0, {"e": expert[None]}, {"e": weight}, tau)  # logits: any shift
    # log(1e-6 / 0.7) = -13.5 is clipped to -10; the other two differences are log 2.5 and log 5.
    shifted = [math.log(0.7) - weight * tau, math.log(0.2) + weight * math.log(2.5),
               math.log(0.1) + weight * math.log((0.5 - 1e-6) / 0.1)]
    total = math.log(sum(math.exp(v) for v in shifted))
    torch.testing.assert_close(composed.log_probs[0], torch.tensor([v - total for v in shifted]), rtol=0, atol=1e-5)
    assert composed.clipped["e"][0].tolist() == [True, False, False]
    term = summarize(composed, {"e": weight}, torch.tensor([True]))["e"]
    expected_norm = weight * math.sqrt(tau ** 2 + math.log(2.5) ** 2 + math.log((0.5 - 1e-6) / 0.1) ** 2)
    assert term.clipped and term.clipped_fraction == pytest.approx(1 / 3)
    assert term.norm == pytest.approx(expected_norm, rel=1e-5)


def test_composition_limits_two_experts_and_weight_zero():
    torch.manual_seed(0)
    base, a, b = torch.randn(3, 2, 4, 7).unbind(0)
    lb, la, lbb = (torch.log_softmax(x, -1) for x in (base, a, b))
    composed = compose(base, {"a": a, "b": b}, {"a": 0.3, "b": 1.2}, tau=0.5)
    expected = torch.log_softmax(lb + 0.3 * (la - lb).clamp(-0.5, 0.5) + 1.2 * (lbb - lb).clamp(-0.5, 0.5), -1)
    torch.testing.assert_close(composed.log_probs, expected)
    torch.testing.assert_close(compose(base, {"a": a}, {"a": 0.0}).log_probs, lb)
    torch.testing.assert_close(compose(base, {"a": a}, {"a": 1.0}, tau=float("inf")).log_probs, la, atol=1e-5, rtol=0)


@pytest.mark.parametrize("experts", [{"a": -1.0}, {"a": float("nan")}, {"a": "heavy"}, {"": 1.0}, "uniform", ["a"]])
def test_bad_expert_arguments_are_refused(experts):
    with pytest.raises(ValueError):
        expert_weights(experts, "prompt")


def test_tau_must_be_positive():
    for tau in (0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            validate_tau(tau)


def test_auto_classifier_rules():
    assert auto_experts("12+345=") == {"addition": 1.0}
    assert auto_experts("def area(r):\n    return 3.14 * r * r") == {"code": 1.0}
    assert auto_experts("def double():\n    return 2 * 21") == {"addition": 1.0, "code": 1.0}
    assert auto_experts("import os\nfor name in os.listdir('.'):\n") == {"code": 1.0}
    assert auto_experts("Once upon a time, from the hills, came a bear.") == {}
    assert expert_weights("auto", "7 + 8") == ({"addition": 1.0}, True)


# ----- one process -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def alpha_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("experts") / "alpha", tiny_config(num_layers=2), seed=7)


def test_weight_zero_gives_the_backbone_alone(local_lm, alpha_path):
    for settings in (dict(seed=0), dict(seed=3, temperature=1.0, remasking="random")):
        alone = local_lm.generate("Hello", **SETTINGS, **settings)
        zero = local_lm.generate("Hello", experts={str(alpha_path): 0.0}, **SETTINGS, **settings)
        assert zero.token_ids == alone.token_ids and torch.equal(zero.sequence, alone.sequence)
        assert all(step["experts"][str(alpha_path)]["weight"] == 0.0 for step in zero.telemetry)


def test_composition_changes_tokens_and_reports_telemetry(local_lm, alpha_path):
    name = str(alpha_path)
    chunks = list(local_lm.generate_stream("Hello", experts={name: 1.0}, expert_tau=2.0, **SETTINGS))
    result = chunks[-1].result
    assert result.token_ids != local_lm.generate("Hello", **SETTINGS).token_ids
    assert len(result.telemetry) == result.steps == 8
    assert [c.telemetry for c in chunks[:-1]] == result.telemetry
    term = result.telemetry[0]["experts"][name]
    assert term["weight"] == 1.0 and term["norm"] > 0 and term["clipped"] is True  # tau=2 on random models
    assert result.info["experts"]["weights"] == {name: 1.0} and result.info["warnings"] == []


def test_corrector_steps_are_deterministic_and_cost_one_call_each(local_lm, alpha_path):
    kwargs = dict(experts={str(alpha_path): 0.5}, corrector_steps=2, temperature=0.7, seed=5, **SETTINGS)
    first, second = local_lm.generate("Hi", **kwargs), local_lm.generate("Hi", **kwargs)
    assert torch.equal(first.sequence, second.sequence)
    assert first.denoiser_calls == 8 * 3
    corrections = first.telemetry[0]["corrector"]
    assert len(corrections) == 2 and all(len(c["remasked"]) == 2 for c in corrections)
    with pytest.raises(ValueError, match="parallel_window"):
        local_lm.generate("Hi", corrector_steps=1, parallel_window=2, **SETTINGS)


def test_stale_pipelining_queries_experts_once_per_call(local_lm, alpha_path):
    """With calls in flight, each call's expert queries start with it and are the ones its logits compose."""
    expert = DiffusionLM.from_pretrained(alpha_path)
    queried = []

    def counted(tokens: torch.Tensor) -> torch.Tensor:
        queried.append(tokens.clone())
        return expert.logits(tokens)

    generation = GenerationConfig(**SETTINGS, staleness=2)
    composition = Composition({"alpha": InProcessExpert(counted, "alpha")}, {"alpha": 0.7}, generation,
                              local_lm.config.mask_token_id, tau=3.0)
    with local_lm.denoising_session(generation) as forward:
        sampler = composition.sampler(DenoiserCalls(forward, generation, local_lm.config.logits_shift))
        events = list(sampler.iterate(local_lm.encode_prompt("Hello there")))
    assert len(events) == SETTINGS["steps"] and sampler.stats.guessed > 0
    assert len(queried) == sampler.stats.denoiser_calls  # none queried again when its call was collected
    composed = local_lm.generate("Hello there", experts={str(alpha_path): 0.7}, expert_tau=3.0, staleness=2,
                                 **SETTINGS)
    assert composed.sequence.tolist() == events[-1].tokens.tolist()


@pytest.mark.parametrize("top_k", [0, 16])
def test_windows_and_drafts_crossing_a_block_compose_each_row_at_its_own_block(local_lm, alpha_path, top_k):
    """A Picard window's or a draft's later rows may decide the next block: each is composed there, as the
    sequential run composes it, so the tokens are the sequential run's (rows composed at the first row's block
    gave other tokens)."""
    kwargs = dict(experts={str(alpha_path): 0.7}, expert_tau=3.0, expert_top_k=top_k, gen_length=16, steps=16,
                  block_length=4)
    for seed in range(4):
        sequential = local_lm.generate("Hello there", seed=seed, **kwargs)
        for fast in (dict(parallel_window=4), dict(draft_steps=3)):
            assert local_lm.generate("Hello there", seed=seed, **fast, **kwargs).token_ids == sequential.token_ids, \
                (seed, fast)


@pytest.mark.parametrize("settings", [dict(), dict(parallel_window=3), dict(corrector_steps=1), dict(staleness=2)])
def test_the_union_composition_gives_the_dense_compositions_tokens(local_lm, alpha_path, monkeypatch, settings):
    """At ``expert_top_k`` > 0 the client composes and predicts over the union of the named ids: greedy, its tokens
    and telemetry are those of the dense composition of the same cut (each block spread to whole rows, the path
    before the union): the same function, computed over fewer numbers."""
    from swarm.diffusion import sampler

    kwargs = dict(experts={str(alpha_path): 0.7}, expert_tau=3.0, expert_top_k=16, temperature=0.0, seed=0,
                  **SETTINGS, **settings)
    fast = local_lm.generate("Hello there", **kwargs)
    cut = sampler.cut_to_top_k
    monkeypatch.setattr(sampler, "cut_to_top_k",
                        lambda logits, blocks, k: cut(logits, blocks, k).dense(logits.shape[1]))
    dense = local_lm.generate("Hello there", **kwargs)
    assert fast.token_ids == dense.token_ids
    for fast_step, dense_step in zip(fast.telemetry, dense.telemetry):
        f, d = fast_step["experts"][str(alpha_path)], dense_step["experts"][str(alpha_path)]
        assert f["norm"] == pytest.approx(d["norm"], rel=1e-4)
        assert f["clipped_fraction"] == pytest.approx(d["clipped_fraction"], abs=1e-6)


@pytest.mark.parametrize(
    "changes, field", [(dict(vocab_size=300), "vocab_size"), (dict(mask_token_id=258), "mask_token_id")]
)
def test_incompatible_expert_is_refused_locally(local_lm, tmp_path, changes, field):
    path = make_checkpoint(tmp_path / "odd", tiny_config(num_layers=1, **changes), seed=1)
    with pytest.raises(IncompatibleExpertError, match=field):
        local_lm.generate("Hello", experts={str(path): 1.0}, **SETTINGS)


def test_auto_composes_the_expert_the_prompt_calls_for():
    """Arithmetic selects the addition expert, which ships with the package (in the shipped backbone's vocabulary):
    composed at weight 1.0."""
    result = DiffusionLM.from_pretrained("default").generate("12+34=", experts="auto", **SETTINGS)
    assert result.info["experts"]["auto"] is True and result.info["experts"]["weights"] == {"addition": 1.0}
    assert result.info["warnings"] == []
    assert len(result.telemetry) == result.steps
    assert all(step["experts"]["addition"]["weight"] == 1.0 and step["experts"]["addition"]["norm"] > 0
               for step in result.telemetry)


def test_composition_evaluation_scores_every_configuration(tiny_model_path, alpha_path):
    from swarm.eval.composition import evaluate_composition, markdown_table

    rows = evaluate_composition(str(tiny_model_path), str(alpha_path), "addition", [0.0, 1.0], examples=2)
    assert [row.examples for row in rows] == [2, 2, 2, 2]
    assert rows[2].samples == rows[0].samples  # weight 0: the backbone's answers
    assert rows[3].experts == {"alpha": 1.0} and len(markdown_table(rows)) == 2 + 4


# ----- the swarm -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def expert_server(local_swarm, tiny_model_path, alpha_path):
    """ONE server hosting only experts: ``alpha`` and ``beta`` (the same checkpoint under two domains)."""
    server = local_swarm.start_server(str(tiny_model_path), None, "--expert", f"alpha={alpha_path}",
                                      "--expert", f"beta={alpha_path}", "--compute-threads", "1", name="experts")
    yield server
    local_swarm.terminate(server)


@pytest.fixture
def forger(local_swarm):
    """A DHT peer that is not a server: it announces experts it cannot serve (or cannot be composed). One per test:
    a client that met a forger's failure avoids that peer, so a shared one would change what the next test sees."""
    identity = Identity.load_or_create(None)
    dht = start_dht(NetworkConfig(initial_peers=local_swarm.initial_peers), identity=identity)

    announced: dict[str, list[ExpertRecord]] = {}

    def announce(prefix: str, domain: str, tag: CompatibilityTag, throughput: float = 1e9) -> None:
        """Add ``domain`` to this peer's one entry of the expert index (every record it announces, as a server)."""
        records = announced.setdefault(prefix, [])
        records.append(ExpertRecord(identity.peer_id, domain, ServerState.ONLINE, tag, throughput))
        assert declare_experts(dht, prefix, records, identity.owner_subkey(), time.time() + 300)

    yield announce
    dht.shutdown()


BYTE_TAG = CompatibilityTag("byte-v1", ByteTokenizer.vocab_size, ByteTokenizer.MASK)


@pytest.mark.parametrize("prompt, settings", [("Hello there", dict(seed=0)),
                                              ("x", dict(seed=2, temperature=0.5, cfg_scale=1.0, parallel_window=2)),
                                              ("Hello there", dict(seed=1, staleness=2, cache="dual"))])
def test_swarm_composition_equals_local(expert_server, remote_lm, local_lm, alpha_path, prompt, settings):
    remote = remote_lm.generate(prompt, experts={"alpha": 0.7}, expert_tau=3.0, **SETTINGS, **settings)
    local = local_lm.generate(prompt, experts={str(alpha_path): 0.7}, expert_tau=3.0, **SETTINGS, **settings)
    assert remote.token_ids == local.token_ids, (remote.info, local.info)
    assert (remote.info["warnings"] == []
            and remote.info["experts"]["sources"]["alpha"]["used"] == [expert_server.peer_id])
    for remote_step, local_step in zip(remote.telemetry, local.telemetry):
        r, loc = remote_step["experts"]["alpha"], local_step["experts"][str(alpha_path)]
        assert r["clipped"] == loc["clipped"] and r["norm"] == pytest.approx(loc["norm"], rel=1e-4)


def test_expert_server_is_announced(expert_server, remote_lm, tiny_model_path):
    prefix = default_prefix(tiny_model_path)
    assert {"alpha", "beta"} <= read_expert_domains(remote_lm.dht, prefix)
    record = read_expert_records(remote_lm.dht, prefix, "alpha")[expert_server.peer_id]
    assert record.tag == BYTE_TAG and record.state == ServerState.ONLINE and record.throughput == 1000


def test_incompatible_remote_expert_is_refused(remote_lm, forger, tiny_model_path):
    forger(default_prefix(tiny_model_path), "wide", CompatibilityTag("byte-v1", 300, 299))
    with pytest.raises(IncompatibleExpertError, match="vocab_size 300"):
        remote_lm.generate("Hello", experts={"wide": 1.0}, **SETTINGS)


def test_incompatible_expert_server_refuses_to_start(tiny_model_path, tmp_path):
    from swarm.server.config import ServerConfig
    from swarm.server.server import Server

    path = make_checkpoint(tmp_path / "wide", tiny_config(num_layers=1, vocab_size=300), seed=1)
    with pytest.raises(IncompatibleExpertError, match="vocab_size"):
        Server(ServerConfig(model=str(tiny_model_path)), [f"wide={path}"])  # fails before joining any DHT


def test_failed_expert_server_is_replaced(expert_server, remote_lm, local_lm, forger, alpha_path, tiny_model_path):
    """``beta``'s preferred server (fastest announced) cannot answer: the real one takes over, same tokens."""
    forger(default_prefix(tiny_model_path), "beta", BYTE_TAG)
    remote = remote_lm.generate("Hello", experts={"beta": 0.7}, **SETTINGS)
    local = local_lm.generate("Hello", experts={str(alpha_path): 0.7}, **SETTINGS)
    assert remote.token_ids == local.token_ids and remote.info["warnings"] == []
    source = remote.info["experts"]["sources"]["beta"]
    assert source["used"][-1] == expert_server.peer_id and len(source["failovers"]) == 1


def test_expert_with_no_server_left_is_dropped_with_a_warning(remote_lm, local_lm, forger, tiny_model_path):
    forger(default_prefix(tiny_model_path), "ghost", BYTE_TAG)
    result = remote_lm.generate("Hello", experts={"ghost": 1.0}, **SETTINGS)
    assert result.token_ids == local_lm.generate("Hello", **SETTINGS).token_ids  # the backbone alone
    assert any("'ghost' dropped at step 0" in warning for warning in result.info["warnings"])
    assert result.info["experts"]["dropped"] == ["ghost"] and result.telemetry[-1]["experts"]["ghost"]["dropped"]


def test_auto_skips_missing_experts_with_a_warning(remote_lm, local_lm):
    """No server of this swarm hosts the addition expert that arithmetic selects: the generation goes on with
    the backbone alone and says which expert it skipped."""
    result = remote_lm.generate("12+34=", experts="auto", **SETTINGS)
    assert result.info["experts"]["auto"] is True and result.info["experts"]["weights"] == {}
    assert len(result.info["warnings"]) == 1 and "'addition'" in result.info["warnings"][0], result.info["warnings"]
    assert result.token_ids == local_lm.generate("12+34=", **SETTINGS).token_ids


# ----- the expert RPC's checks -----------------------------------------------------------------------------
def call_expert(remote_lm, peer_id: str, message):
    async def call():
        stub = SpanService.get_stub(remote_lm.p2p, PeerID.from_base58(peer_id))
        return [part async for part in await stub.rpc_expert_logits(message)]

    return raw_answer(lambda: remote_lm.loop.run(call(), timeout=30), peer_id)


def request(**changes):
    fields = dict(domain="alpha", tokens=torch.randint(0, 256, (2, 10)), start=2, end=6)
    fields.update(changes)
    return expert_query_message(ExpertQuery(**fields))


def float_tokens():
    message = request()
    message.tensors[0].CopyFrom(serialize_torch_tensor(torch.rand(2, 10)))
    return message


def forged_shape():
    message = request()
    del message.tensors[0].size[:]
    message.tensors[0].size.extend([1, 2**31 - 1])
    return message


HOSTILE = {
    "unknown domain": (lambda: request(domain="zeta"), ErrorCode.NO_EXPERT),
    "float tokens": (float_tokens, ErrorCode.BAD_REQUEST),
    "ids out of range": (lambda: request(tokens=torch.full((1, 5), 999)), ErrorCode.BAD_REQUEST),
    "negative ids": (lambda: request(tokens=torch.full((1, 5), -1)), ErrorCode.BAD_REQUEST),
    "positions past the end": (lambda: request(start=4, end=11), ErrorCode.BAD_REQUEST),
    "empty positions": (lambda: request(start=4, end=4), ErrorCode.BAD_REQUEST),
    "one-dimensional": (lambda: request(tokens=torch.arange(5)), ErrorCode.BAD_REQUEST),
    "forged huge shape": (forged_shape, ErrorCode.TOO_LARGE),
    "longer than the context": (lambda: request(tokens=torch.zeros(1, 600, dtype=torch.long), start=0, end=1),
                                ErrorCode.TOO_LARGE),
    "top_k over the bound": (lambda: request(top_k=MAX_EXPERT_TOP_K + 1), ErrorCode.BAD_REQUEST),
    "negative top_k": (lambda: request(top_k=-1), ErrorCode.BAD_REQUEST),
    "top_k as text": (lambda: request(top_k="64"), ErrorCode.BAD_REQUEST),
    "top_k as a float": (lambda: request(top_k=2.5), ErrorCode.BAD_REQUEST),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_expert_requests_get_structured_errors(expert_server, remote_lm, case):
    make, code = HOSTILE[case]
    with pytest.raises(RemoteError) as caught:
        call_expert(remote_lm, expert_server.peer_id, make())
    assert caught.value.code == code, caught.value


def test_a_sparse_answer_is_the_local_top_k_exactly_and_small(expert_server, remote_lm, alpha_path):
    """The server's top-k answer, checked as the client checks it, holds the very numbers the local expert gives
    (one function on both sides), at k x 8 bytes per position."""
    from swarm.frontend.local import DiffusionLM

    tokens = torch.randint(0, 256, (2, 10))
    message = request(tokens=tokens, top_k=16)
    scores, metadata = call_expert(remote_lm, expert_server.peer_id, message)
    answer = SparseScores.from_wire(scores, metadata["prompts"], ByteTokenizer.vocab_size)
    answer.check((2, 4), 16)
    local = expert_scores(block_log_probs(DiffusionLM.from_pretrained(alpha_path).logits(tokens), 2, 6), 16)
    assert torch.equal(answer.ids, local.ids) and torch.equal(answer.log_probs, local.log_probs)
    assert torch.equal(answer.rest, local.rest)
    assert scores.numel() * 4 + metadata["prompts"].numel() * 4 == 2 * 4 * (16 * 8 + 4)


def test_a_server_whose_sparse_answers_are_malformed_is_banned_and_replaced(local_swarm, expert_server, remote_lm,
                                                                           local_lm, alpha_path, tiny_model_path):
    """A server announced fastest for ``alpha`` answers malformed top-k scores: refused, banned, failed over to
    the honest server; the tokens are the local run's."""
    liar = local_swarm.start_server(str(tiny_model_path), None, "--expert", f"alpha={alpha_path}", "--throughput",
                                    "1000000", "--compute-threads", "1", name="lying-expert",
                                    entry=(str(Path(__file__).with_name("lying_expert_server.py")),))
    try:
        assert wait_until(lambda: liar.peer_id in read_expert_records(remote_lm.dht, remote_lm.prefix, "alpha"),
                          timeout=30, interval=1.0)  # a DHT read each time
        remote = remote_lm.generate("Hello", experts={"alpha": 0.7}, expert_top_k=16, **SETTINGS)
        local = local_lm.generate("Hello", experts={str(alpha_path): 0.7}, expert_top_k=16, **SETTINGS)
        assert remote.token_ids == local.token_ids and remote.info["warnings"] == []
        source = remote.info["experts"]["sources"]["alpha"]
        assert source["used"][0] == liar.peer_id and source["used"][-1] == expert_server.peer_id
        assert "sparse answer refused" in source["failovers"][0]["error"], source["failovers"]
        assert not remote_lm.sequence.health.usable(liar.peer_id)
    finally:
        local_swarm.terminate(liar)


def test_expert_rpc_answers_and_forward_is_refused_on_an_expert_only_server(expert_server, remote_lm, alpha_path):
    from swarm.frontend.local import DiffusionLM

    tokens = torch.randint(0, 256, (2, 10))
    log_probs, _ = call_expert(remote_lm, expert_server.peer_id, request(tokens=tokens))
    expected = torch.log_softmax(DiffusionLM.from_pretrained(alpha_path).logits(tokens)[:, 2:6], -1)
    torch.testing.assert_close(log_probs, expected, rtol=1e-4, atol=1e-4)
    from swarm.wire.encoding import request_parts
    from swarm.wire.messages import ForwardRequest

    async def forward():
        stub = SpanService.get_stub(remote_lm.p2p, PeerID.from_base58(expert_server.peer_id))
        return [await stub.rpc_forward(request_parts(ForwardRequest(0, 1, torch.randn(1, 3, 32)))[0], timeout=20)]

    with pytest.raises(RemoteError) as caught:
        collect_response(remote_lm.loop.run(forward(), timeout=30), expert_server.peer_id)
    assert caught.value.code == ErrorCode.WRONG_SPAN


def test_composition_cost_benchmark_times_both_rows():
    """``python -m swarm.benchmark composition-cost``: every stage of the client's composition is timed, for the
    top k and for the whole vocabulary (small sizes here; LLaDA-8B's vocabulary by default)."""
    from click.testing import CliRunner

    from swarm.benchmark import main as benchmark

    result = CliRunner().invoke(benchmark, ["composition-cost", "--vocab", "300", "--positions", "4", "--top-k",
                                            "8", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split() for line in result.output.splitlines() if line.startswith(("top", "whole"))}
    assert set(rows) == {"top", "whole"} and all(len(values) == 8 for values in rows.values()), result.output
