"""The output head on the swarm (issue 17, item 3): a server started with ``--head`` answers the sampler's
predictions instead of hidden states, the client loads no head, and the tokens equal the local model's for
greedy and sampled decoding, every remasking strategy, threshold decoding, guidance and Picard windows. What
needs logits (the activation cache's reuses, experts, correctors, staleness) falls back to the client's head."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import swarm
from swarm.client import DistributedDiffusionLM
from swarm.client.spot_check import answers_agree
from swarm.diffusion.config import MAX_STALENESS
from swarm.diffusion.prediction import (
    HeadQuery,
    Predictions,
    check_predictions,
    cut_to_top_k,
    exact_columns,
    guided,
    masked_scores,
    predict_block,
    predict_states,
)
from swarm.diffusion.remasking import STRATEGIES
from swarm.models.loading import ModelFiles
from tests.conftest import (
    known_server,
    later_users,
    make_checkpoint,
    stop_all,
    tiny_config,
    wait_all,
    wait_seen,
)
from tests.test_bottleneck import bottleneck_for
from tests.test_deep_prompt import deep_adapter_for
from tests.test_finetune import adapter_for
from tests.test_formats import dream_path, llada_path  # noqa: F401  (module fixtures: small bfloat16 checkpoints)
from tests.test_lora import lora_for

PROMPT = "the cat sat"
SHORT = dict(gen_length=16, steps=8, block_length=8, seed=5)
ON_THE_SWARM = {
    "greedy": {},
    "temperature": dict(temperature=0.8),
    **{f"remasking={name}": dict(remasking=name, temperature=0.7) for name in STRATEGIES},
    "threshold": dict(threshold=0.2, temperature=0.7),
    "cfg": dict(cfg_scale=1.5, temperature=0.7),
    "picard window": dict(parallel_window=3, temperature=0.7),
    "dual cache": dict(cache="dual", temperature=0.7),
    "prefix cache, refresh 2": dict(cache="prefix", cache_refresh=2),
    # the adaptive refresh compares margins, which the head server answers: the same fills as the local run
    "dual cache, adaptive refresh": dict(cache="dual", cache_refresh_drift=0.02, temperature=0.7),
    # a stale step decides on an older state's answer, drawn with its own step's noise (HeadQuery.ahead)
    "staleness 1": dict(staleness=1, temperature=0.7),
    "staleness 3, exact check": dict(staleness=3, stale_check="exact", temperature=0.7, remasking="random"),
    "staleness 2, unchecked": dict(staleness=2, stale_check="none", temperature=0.7),
    "staleness 2, greedy": dict(staleness=2),
    "staleness 5, token check": dict(staleness=5, temperature=0.7),  # ahead past 3 (MAX_STALENESS was 3)
    # a corrector's calls are predicted there too, drawn with the corrector's own seed (corrector_seed)
    "corrector": dict(corrector_steps=1, temperature=0.7),
    "two correctors, greedy": dict(corrector_steps=2),
}

QUERY = HeadQuery((4,), 4, (0,), seed=1, temperature=0.5, cfg_scale=0.0, mask_token_id=3, scored=(4, 8))


# ----- the contract, without a network --------------------------------------------------------------------
def test_a_head_query_is_checked_against_its_call():
    value = QUERY.to_dict()
    assert HeadQuery.parse(value, batch=1, length=8, vocab_size=10) == QUERY
    bad = {
        "states and batch differ": (dict(value), 2),
        "guidance needs the copies": (dict(value, cfg_scale=1.0), 1),
        "block outside the scored rows": (dict(value, block_starts=[5]), 1),
        "rows past the sequence": (dict(value, scored=[4, 9]), 1),
        "steps and states differ": (dict(value, steps=[0, 1]), 1),
        "mask outside the vocabulary": (dict(value, mask_token_id=10), 1),
        "NaN temperature": (dict(value, temperature=float("nan")), 1),
        "not a list": (dict(value, block_starts="4"), 1),
        "huge list": (dict(value, steps=list(range(5000))), 1),
        "bool as an int": (dict(value, seed=True), 1),
        "ahead past the staleness bound": (dict(value, ahead=MAX_STALENESS + 1), 1),
        "ahead with a cut": (dict(value, ahead=1, top_k=2), 1),
        "negative ahead": (dict(value, ahead=-1), 1),
    }
    for name, (query, batch) in bad.items():
        with pytest.raises(ValueError):
            HeadQuery.parse(query, batch=batch, length=8, vocab_size=10)
            pytest.fail(name)
    # A reuse of the activation cache sends rows first:first + length only: the scored rows must lie there.
    assert HeadQuery.parse(value, batch=1, length=4, vocab_size=10, first=4) == QUERY
    for first, length in ((5, 4), (0, 4), (4, 3)):
        with pytest.raises(ValueError):
            HeadQuery.parse(value, batch=1, length=length, vocab_size=10, first=first)


def test_predictions_ahead_are_each_later_steps_own_draws():
    """``ahead``: a state's block is also predicted with the noise of later steps, each as the sampler draws it
    from the same logits; the tokens lead the columns (what two honest servers agree on exactly)."""
    torch.manual_seed(1)
    logits = torch.randn(1, 4, 12)
    query = HeadQuery((0,), 4, (5,), seed=3, temperature=0.9, cfg_scale=0.0, mask_token_id=0, scored=(0, 4), ahead=2)
    assert HeadQuery.parse(query.to_dict(), batch=1, length=4, vocab_size=12) == query
    answer = predict_states(logits, query)
    assert answer.shape == (1, 4, 12) and check_predictions(answer, query, vocab_size=12) is None
    assert exact_columns(answer) == 3
    state = Predictions(answer, query, 12)[0]
    for step in (5, 6, 7):
        expected = predict_block(masked_scores(logits[0], 0), 0.9, 3, step)
        assert torch.equal(state.at(step), expected) and torch.equal(answer[0, :, step - 5], expected[:, 0])
    assert torch.equal(state.at(9), state.at(5)), "a step not drawn reads the state's own step's rows"


def test_predictions_are_the_samplers_own_numbers():
    """A head server's answer is what the sampler computes from the same logits, guidance included."""
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 12)  # two states and their unconditional copies, rows 2:8 scored
    query = HeadQuery((2, 4), 4, (3, 4), seed=9, temperature=0.9, cfg_scale=1.5, mask_token_id=0, scored=(2, 8))
    answer = predict_states(logits, query)
    combined = guided(logits, 2, 1.5)
    for i, (start, step) in enumerate(zip(query.block_starts, query.steps)):
        rows = combined[i, start - 2:start + 2]
        assert torch.equal(answer[i], predict_block(masked_scores(rows, 0), 0.9, 9, step))
    assert check_predictions(answer, query, vocab_size=12) is None
    assert not (answer[..., 0] == 0).any(), "the mask token is never predicted"


def test_a_malformed_answer_is_refused():
    answer = predict_states(torch.randn(1, 4, 10), QUERY)
    assert check_predictions(answer, QUERY, 10) is None
    broken = {"shape": answer[:, :2], "dtype": answer.float()}
    for column, value in ((0, 3.0), (0, 10.0), (0, 1.5), (1, 1.5), (2, -0.1), (2, 1.1), (3, 0.5), (1, float("nan"))):
        changed = answer.clone()
        changed[0, 0, column] = value
        broken[f"column {column} = {value}"] = changed
    for name, tensor in broken.items():
        assert check_predictions(tensor, QUERY, 10) is not None, name


def test_one_wrong_token_fails_a_spot_check():
    """Token ids are large numbers: a relative norm would hide one wrong id, so they are compared exactly."""
    answer = predict_states(torch.randn(1, 4, 200), QUERY)
    lying = answer.clone()
    lying[0, 1, 0] = (lying[0, 1, 0] + 1) % 200 or 1
    assert answers_agree(answer, answer.clone(), 1e-3)
    assert not answers_agree(answer, lying, 1e-3)


# ----- through a swarm ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def alpha_expert(tmp_path_factory) -> Path:
    """A tiny expert checkpoint (2 layers, the tiny model's tokenizer), hosted by ``head_swarm``'s first server."""
    return make_checkpoint(tmp_path_factory.mktemp("alpha"), tiny_config(num_layers=2), seed=7)


@pytest.fixture(scope="module")
def head_swarm(local_swarm, tiny_model_path, swarm_peer, alpha_expert):
    """Servers 0:2 (hosting the expert ``alpha`` too: a server of its own would be a process and a daemon more) and
    2:4 (with the head) of the tiny model under a prefix of their own, and a client."""
    prefix = "head-test"
    servers = [local_swarm.start_server(str(tiny_model_path), span, "--dht-prefix", prefix, "--compute-threads",
                                        "1", *extra, name=f"head-{span}", wait=False)
               for span, extra in (("0:2", ("--expert", f"alpha={alpha_expert}")), ("2:4", ("--head",)))]
    for server in servers:
        local_swarm.wait_ready(server)
    # Checks off: where the head runs is tested here, and a checked head hop loads the client's head (no second head
    # server holds these blocks: the client scores a replica's or its own recomputed hidden states)
    with DistributedDiffusionLM.from_pretrained(tiny_model_path, dht=swarm_peer,
                                                dht_prefix=prefix, request_timeout=20, spot_check_fraction=0) as lm:
        yield lm, servers
    stop_all(local_swarm, [server for server in servers if server.alive])  # their own prefix


@pytest.mark.parametrize("name", list(ON_THE_SWARM))
def test_head_on_the_swarm_gives_the_local_tokens(head_swarm, local_lm, name):
    lm, _ = head_swarm
    settings = dict(SHORT, **ON_THE_SWARM[name])
    remote, local = lm.generate(PROMPT, **settings), local_lm.generate(PROMPT, **settings)
    assert remote.token_ids == local.token_ids
    assert remote.info["cache"]["fills"] == local.info["cache"]["fills"]
    assert remote.info["cache"]["drift_fills"] == local.info["cache"]["drift_fills"]
    assert lm._head is None, "the client loaded the head although the swarm's answered"
    assert remote.info["head"]["client_calls"] == 0 and remote.info["head"]["server_calls"] > 0
    assert lm.show_route()[-1].end == 4 and lm.planner.servers[lm.show_route()[-1].peer_id].head


WHOLE_LOGITS = "the sampler reads whole logits (experts composed over the whole vocabulary, expert_top_k=0)"
ADAPTERS = {  # every kind, none correcting the head: soft and deep prompts add positions in front of the rows
    "soft prompt": lambda lm: adapter_for(lm, length=3, seed=2),
    "deep prompt": lambda lm: deep_adapter_for(lm, length=2, seed=2),
    "bottleneck": lambda lm: bottleneck_for(lm, rank=2, seed=2),
    "lora": lambda lm: lora_for(lm, rank=2, seed=2),
}


@pytest.mark.parametrize("kind", list(ADAPTERS))
def test_an_adapter_is_predicted_on_the_head_server_without_the_clients_head(head_swarm, local_lm, tmp_path, kind):
    """The query is shifted past an adapter's prompt positions, so the head server scores the rows the client's
    head would: the local tokens, through a plain pass and a dual cache's reuses, and no call on the client."""
    lm, _ = head_swarm
    path = str(ADAPTERS[kind](local_lm).save(tmp_path / "adapter"))
    for options in ({}, {"cache": "dual", "temperature": 0.7}):
        settings = dict(SHORT, adapter=path, **options)
        result = lm.generate(PROMPT, **settings)
        assert result.token_ids == local_lm.generate(PROMPT, **settings).token_ids, options
        assert result.info["head"] == {"server_calls": result.denoiser_calls, "client_calls": 0,
                                       "client_reasons": []}, options
    assert local_lm.generate(PROMPT, adapter=path, **SHORT).token_ids != local_lm.generate(PROMPT, **SHORT).token_ids


def test_an_adapter_that_corrects_the_head_is_scored_by_the_clients_head(head_swarm, local_lm, tmp_path):
    lm, _ = head_swarm
    path = str(bottleneck_for(local_lm, rank=2, seed=3, head_rank=2).save(tmp_path / "head-corrected"))
    try:
        result = lm.generate(PROMPT, adapter=path, **SHORT)
    finally:  # the shared client loaded its head here: the other tests check that it does not (any order)
        lm._head = None
    assert result.token_ids == local_lm.generate(PROMPT, adapter=path, **SHORT).token_ids
    assert result.info["head"]["server_calls"] == 0 and result.info["head"]["client_reasons"] == [
        "the adapter corrects the head, which only this client holds"]


EXPERT_SETTINGS = {"greedy": {}, "guidance": dict(temperature=0.7, cfg_scale=1.0),
                   "picard window": dict(parallel_window=3, temperature=0.7), "dual cache": dict(cache="dual"),
                   "staleness": dict(staleness=2, temperature=0.7),
                   "corrector": dict(corrector_steps=1, temperature=0.7)}


def test_experts_compose_on_the_head_servers_cut_without_the_clients_head(head_swarm, tiny_model_path, local_lm,
                                                                          alpha_expert, swarm_peer):
    """With experts at ``expert_top_k`` > 0 the head server answers each block cut to its top k after guidance and
    the client composes the experts' top k with it: the local tokens (the local sampler cuts its own logits the
    same way), and the client never loads its head. With the whole vocabulary the client scores hidden states."""
    with DistributedDiffusionLM.from_pretrained(tiny_model_path, dht=swarm_peer,
                                                dht_prefix="head-test", request_timeout=20,
                                                spot_check_fraction=0) as fresh:  # a checked head hop loads it
        for name, settings in EXPERT_SETTINGS.items():
            kwargs = dict(SHORT, expert_tau=3.0, expert_top_k=16, **settings)
            remote = fresh.generate(PROMPT, experts={"alpha": 0.7}, **kwargs)
            local = local_lm.generate(PROMPT, experts={str(alpha_expert): 0.7}, **kwargs)
            assert remote.token_ids == local.token_ids, name
        assert fresh._head is None, "the client loaded its head although the head server cut the blocks"
        whole = dict(SHORT, expert_tau=3.0, expert_top_k=0)
        result = fresh.generate(PROMPT, experts={"alpha": 0.7}, **whole)
        assert result.token_ids == local_lm.generate(PROMPT, experts={str(alpha_expert): 0.7}, **whole).token_ids
        assert fresh._head is not None and result.info["head"]["client_reasons"] == [WHOLE_LOGITS]


def test_a_client_that_keeps_the_head_gets_the_same_tokens(local_swarm, head_swarm, tiny_model_path, local_lm,
                                                           swarm_peer):
    settings = dict(SHORT, temperature=0.7)
    with DistributedDiffusionLM.from_pretrained(tiny_model_path, dht=swarm_peer,
                                                dht_prefix="head-test", head="client") as lm:
        assert lm.generate(PROMPT, **settings).token_ids == local_lm.generate(PROMPT, **settings).token_ids
        assert lm._head is not None


def test_head_requests_are_checked_by_the_server(head_swarm, remote_lm):
    """A head query that does not fit its call, or sent to a server without the head, is refused with its reason;
    a hop that does not end at the last block ignores it (it travels with every pushed hop)."""
    from swarm.wire.messages import ErrorCode, ForwardRequest, RemoteError

    lm, _ = head_swarm
    hidden = torch.randn(1, 8, lm.config.hidden_size)
    query = HeadQuery((4,), 4, (0,), 1, 0.5, 0.0, lm.config.mask_token_id, (4, 8))
    head_peer = known_server(lm, lambda record: record.head)
    first = known_server(lm, lambda record: record.start == 0)
    no_head = known_server(remote_lm, lambda record: (record.start, record.end) == (2, 4))
    refused = ((head_peer, 2, dataclasses.replace(query, block_starts=(6,)), ErrorCode.BAD_REQUEST),
               (no_head, 2, query, ErrorCode.WRONG_SPAN))
    for peer, start, head, code in refused:
        with pytest.raises(RemoteError) as error:
            lm.loop.run(lm.caller.forward(peer, ForwardRequest(start, 4, hidden, "s", 0, head=head), 10))
        assert error.value.code == code, error.value
    answer = lm.loop.run(lm.caller.forward(head_peer, ForwardRequest(2, 4, hidden, "s", 0, head=query), 10))
    assert answer.dtype == torch.float64 and answer.shape == (1, 4, 4)
    passed_on = lm.loop.run(lm.caller.forward(first, ForwardRequest(0, 2, hidden, "s", 0), 10))
    assert passed_on.shape == hidden.shape


def test_losing_the_head_server_mid_run_keeps_the_tokens(request, local_swarm, head_swarm, tiny_model_path, local_lm,
                                                         swarm_peer):
    """The head server dies mid-generation: the step goes on over a replica without the head, whose hidden states
    the client now scores itself (loading its head then); the tokens do not change. On the module's servers and a
    replica of 2:4 started for it (three servers of their own cost three boots); the head server starts again
    afterwards if a later test of the module uses it (a shuffled run found a kill that took it from every one)."""
    lm, servers = head_swarm
    head_server = next(server for server in servers if server.span == (2, 4))
    replica = local_swarm.start_server(str(tiny_model_path), "2:4", "--dht-prefix", "head-test", "--compute-threads",
                                       "1", name="head-test-2:4-replica")
    settings = dict(SHORT, temperature=0.7)
    try:
        with DistributedDiffusionLM.from_pretrained(tiny_model_path, dht=swarm_peer,
                                                    dht_prefix="head-test", request_timeout=20,
                                                    spot_check_fraction=0) as fresh:  # a checked head hop loads it
            wait_seen(fresh, [*servers, replica])
            chunks = fresh.generate_stream(PROMPT, **settings)
            next(chunks)
            assert fresh._head is None and fresh.show_route()[-1].peer_id == head_server.peer_id
            local_swarm.terminate(head_server)
            result = [chunk for chunk in chunks][-1].result
            assert result.token_ids == local_lm.generate(PROMPT, **settings).token_ids
            assert fresh._head is not None and result.info["failovers"]
    finally:
        local_swarm.terminate(replica)  # announced as leaving: the module's client never routes to it
        if not head_server.alive and later_users(request, "head_swarm"):
            servers[servers.index(head_server)] = local_swarm.restart(head_server)
            wait_seen(lm, servers)


@pytest.fixture(scope="module")
def bfloat16_head_servers(local_swarm, llada_path, dream_path):  # noqa: F811
    """Per layout: its checkpoint, prefix and one server of every block with the head, both booting at once."""
    paths = {"llada": llada_path, "dream": dream_path}
    servers = {layout: local_swarm.start_server(str(path), f"0:{ModelFiles(path).config.num_layers}", "--dht-prefix",
                                                f"head-{layout}", "--head", "--compute-threads", "1",
                                                name=f"head-{layout}", wait=False) for layout, path in paths.items()}
    wait_all(local_swarm, servers.values())
    yield {layout: (paths[layout], f"head-{layout}", server) for layout, server in servers.items()}
    stop_all(local_swarm, servers.values())  # their own prefixes


@pytest.mark.parametrize("layout", ["llada", "dream"])
def test_bfloat16_checkpoints_with_the_head_on_the_swarm(local_swarm, layout, bfloat16_head_servers, swarm_peer):
    """Default settings everywhere (bfloat16 from the checkpoint's config): the swarm's tokens are the local
    model's with the head on a server, for both published layouts (Dream's one-row shift included)."""
    path, prefix, _ = bfloat16_head_servers[layout]
    local = swarm.DiffusionLM.from_pretrained(path)
    with DistributedDiffusionLM.from_pretrained(path, dht=swarm_peer,
                                                dht_prefix=prefix, spot_check_fraction=0) as lm:  # checks load a head
        for settings in (dict(gen_length=8, steps=8, block_length=4, seed=2),
                         dict(gen_length=8, steps=4, block_length=4, seed=2, temperature=0.8, cfg_scale=1.0)):
            assert lm.generate(PROMPT, **settings).token_ids == local.generate(PROMPT, **settings).token_ids
        assert lm._head is None


def test_predictions_object_indexes_states():
    answer = predict_states(torch.randn(1, 4, 10), QUERY)
    predictions = Predictions(answer, QUERY)
    assert len(predictions) == 1 and predictions[0].block_start == 4 and predictions[0].step == 0


def test_a_lying_head_server_is_caught_by_spot_checks(local_swarm, tiny_model_path, local_lm, swarm_peer):
    """A head server that answers well-formed predictions with wrong tokens (announcing itself by far the fastest,
    so it is routed to whatever the round trips measured on a busy machine) is outvoted by two honest head
    servers, distrusted, and the tokens stay the local model's."""
    prefix = "head-liar"
    common = ("--dht-prefix", prefix, "--compute-threads", "1", "--head")
    honest = [local_swarm.start_server(str(tiny_model_path), "0:4", *common, "--throughput", "1",
                                       name=f"head-honest-{i}", wait=False) for i in range(2)]
    liar = local_swarm.start_server(str(tiny_model_path), "0:4", *common, "--throughput", "1e9", name="head-liar",
                                    entry=(str(Path(__file__).with_name("faulty_server.py")),), wait=False)
    servers = honest + [liar]
    settings = dict(SHORT, temperature=0.7)
    try:
        for server in servers:
            local_swarm.wait_ready(server)
        with DistributedDiffusionLM.from_pretrained(tiny_model_path, dht=swarm_peer,
                                                    dht_prefix=prefix, spot_check_fraction=1.0) as lm:
            wait_seen(lm, [liar])
            assert lm.show_route()[0].peer_id == liar.peer_id, "the liar should be the first choice"
            result = lm.generate(PROMPT, **settings)
            assert result.token_ids == local_lm.generate(PROMPT, **settings).token_ids
            assert liar.peer_id in result.info["distrusted"]
            assert result.info["spot_checks"][0]["verdict"] == "primary_faulty"
            assert lm._head is None
    finally:
        stop_all(local_swarm, servers)  # their own prefix


def test_a_sparse_head_answer_is_the_local_cut_and_a_malformed_one_is_refused():
    """With ``top_k`` the head server answers each block cut to its top k after guidance: exactly what the local
    sampler's cut gives; duplicate or unsorted ids, ids past the vocabulary, log-probabilities above 0 or a rest
    that does not fit are refused (counted as the server's failure), and so is a top_k over the bound."""
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 12)
    query = HeadQuery((2, 4), 4, (3, 4), seed=9, temperature=0.9, cfg_scale=1.5, mask_token_id=0, scored=(2, 8),
                      top_k=3)
    answer = predict_states(logits, query)
    assert answer.shape == (2, 4, 7) and check_predictions(answer, query, vocab_size=12) is None
    local = cut_to_top_k(guided(logits, 2, 1.5), [(0, 4), (2, 6)], 3)  # blocks relative to the scored rows
    remote = Predictions(answer, dataclasses.replace(query, block_starts=(0, 2)), vocab_size=12).cut()
    assert torch.equal(remote.dense(6).nan_to_num(-7.0), local.dense(6).nan_to_num(-7.0))
    broken = {}
    for name, (column, value) in {"duplicate id": (1, None), "id past the vocabulary": (2, 12.0),
                                  "fractional id": (0, 0.5), "log-probability above 0": (3, 0.5),
                                  "rest that does not fit": (6, 0.0)}.items():
        changed = answer.clone()
        changed[0, 0, column] = changed[0, 0, 0] if value is None else value
        broken[name] = changed
    for name, tensor in broken.items():
        assert check_predictions(tensor, query, 12) is not None, name
    with pytest.raises(ValueError):
        HeadQuery.parse(dict(query.to_dict(), top_k=13), batch=4, length=8, vocab_size=12)
    with pytest.raises(ValueError):
        HeadQuery.parse(dict(query.to_dict(), top_k=True), batch=4, length=8, vocab_size=12)
