"""Bottleneck adapters (issue 19): a residual MLP of rank r per block on every row, its weights held by the client and
carried by every forward and backward request like a deep prompt's vectors; and the head correction any adapter
may carry (LoRA on the client's output head, never sent).

Gradients through real servers equal local autograd (float32); the adapter gives the same tokens locally and through
the swarm (plain, dual cache, Picard windows); it is row by row, so a cache reuse computes what the full pass did;
servers refuse an unknown kind and a malformed bottleneck tensor and go on serving; bad adapter files are refused;
the command trains one through the swarm and refuses to resume it at another rank. A head correction gives the same
tokens locally and through the swarm, is the identity when its up projection is zero, and bad head tensors are
refused.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from swarm.adapters.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterConfig,
    BottleneckAdapter,
    PromptAdapter,
    base_of,
)
from swarm.adapters.block import BlockAdapter, add_bottleneck
from swarm.adapters.kinds import BOTTLENECK, DEEP_PROMPT
from swarm.adapters.lora import BlockWidths
from swarm.finetune.__main__ import main as finetune_main
from swarm.server.validation import validate_prompt_declared
from swarm.wire.encoding import request_parts
from swarm.wire.messages import ErrorCode, ForwardRequest, RemoteError
from tests.conftest import holder_of, start_all, stop_all
from tests.test_deep_prompt import _edit_json, _set_metadata, adapter_gradient, assert_files_refused, raw_call
from tests.test_finetune import GENERATION, TOLERANCE, run_finetune, write_pairs

OLD_SERVER = (str(Path(__file__).with_name("old_server.py")),)


def bottleneck_for(lm, rank: int = 2, seed: int = 0, scale: float = 0.5, head_rank: int = 0) -> BottleneckAdapter:
    """Random down and up projections for every block (up nonzero, so the adapter changes what blocks see), and
    a random head correction of ``head_rank``."""
    config = AdapterConfig(0, lm.config.hidden_size, base_of(lm.config, lm.tokenizer), BOTTLENECK,
                           num_blocks=lm.config.num_layers, rank=rank, head_rank=head_rank,
                           vocab_size=lm.config.vocab_size if head_rank else 0)
    generator = torch.Generator().manual_seed(seed)
    head = tuple(torch.randn(shape, generator=generator) for shape in config.head_shapes) if head_rank else None
    return BottleneckAdapter(config, scale * torch.randn(config.shape, generator=generator), head)


def test_the_bottleneck_is_row_by_row_and_starts_as_the_identity():
    hidden, weights = torch.randn(2, 9, 32), torch.randn(8, 32)
    full = add_bottleneck(hidden, weights)
    assert torch.equal(add_bottleneck(hidden[:, 3:7], weights), full[:, 3:7])  # what a cache reuse computes
    assert not torch.allclose(full, hidden)
    weights[4:] = 0  # the up projections of a new adapter
    assert torch.equal(add_bottleneck(hidden, weights), hidden)


def test_bottleneck_gradients_through_the_swarm_equal_local_autograd(remote_lm, local_lm, tmp_path):
    adapter = bottleneck_for(local_lm)
    local_loss, local_grad = adapter_gradient(local_lm, tmp_path, adapter)
    swarm_loss, swarm_grad = adapter_gradient(remote_lm, tmp_path, adapter)
    assert len({hop.peer_id for hop in remote_lm.planner.route}) >= 2  # the weights are split between servers
    rank = adapter.config.rank
    for block in range(local_lm.config.num_layers):  # both projections of every block get a gradient
        assert local_grad[block, :rank].abs().max() > 1e-4 and local_grad[block, rank:].abs().max() > 1e-4
    assert swarm_loss == pytest.approx(local_loss, abs=1e-6)
    assert (swarm_grad - local_grad).abs().max().item() <= TOLERANCE


def test_a_bottleneck_gives_the_same_tokens_locally_and_through_the_swarm(remote_lm, local_lm, tmp_path):
    adapter = bottleneck_for(local_lm, rank=3, seed=5)
    path = adapter.save(tmp_path / "bottleneck")
    plain = local_lm.generate("adapt", **GENERATION).token_ids
    for options in ({}, {"cache": "dual", "cache_refresh": 2}, {"remasking": "random", "parallel_window": 2}):
        local = local_lm.generate("adapt", adapter=str(path), **GENERATION, **options)
        swarm = remote_lm.generate("adapt", adapter=str(path), **GENERATION, **options)
        assert swarm.token_ids == local.token_ids, options
    assert local_lm.generate("adapt", adapter=str(path), **GENERATION).token_ids != plain  # it changes the text
    identity = adapter.prompts.detach().clone()
    identity[:, adapter.config.rank:] = 0
    fresh = BottleneckAdapter(adapter.config, identity).save(tmp_path / "identity")
    assert remote_lm.generate("adapt", adapter=str(fresh), **GENERATION).token_ids == plain


@pytest.mark.parametrize("case, message", [
    ("kind", "'prompt_kind' must be one of deep_prompt, bottleneck, lora, got 'houlsby'"),
    ("odd", "2 x rank rows per block, got 3"),
])
def test_servers_refuse_a_malformed_bottleneck_and_go_on(remote_lm, local_lm, case, message):
    server = holder_of(remote_lm, 0, 2)
    hidden = torch.randn(1, 5, 32)
    weights = torch.randn(2, 3 if case == "odd" else 4, 32)
    parts = request_parts(ForwardRequest(0, 2, hidden, adapter=BlockAdapter(BOTTLENECK, weights)))
    if case == "kind":
        _set_metadata(parts[0], prompt_kind="houlsby")
    with pytest.raises(RemoteError, match=message) as refused:
        raw_call(remote_lm, server, parts)
    assert refused.value.code == ErrorCode.BAD_REQUEST
    weights = torch.randn(2, 4, 32)
    adapter = BlockAdapter(BOTTLENECK, weights)
    output, _ = raw_call(remote_lm, server, request_parts(ForwardRequest(0, 2, hidden, adapter=adapter)))
    with torch.no_grad():
        expected = local_lm.model.span(hidden, blocks=(0, 2), adapter=adapter)
        as_deep_prompt = local_lm.model.span(hidden, blocks=(0, 2), adapter=BlockAdapter(DEEP_PROMPT, weights))
    assert (output - expected).abs().max().item() <= TOLERANCE
    assert (output - as_deep_prompt).abs().max().item() > 1e-3  # the server applied it as the kind says


def test_a_bottleneck_declaration_is_checked_before_receiving():
    declared = {"prompt_length": 8, "prompt_parts": 1, "prompt_kind": BOTTLENECK}
    widths = BlockWidths(32, 4, 2, 64)
    assert validate_prompt_declared(declared, 4, 100, widths) == (8, 1, BOTTLENECK)
    for kind in (7, None, "deep"):
        with pytest.raises(RemoteError, match="'prompt_kind' must be one of"):
            validate_prompt_declared(dict(declared, prompt_kind=kind), 4, 100, widths)


def test_bad_bottleneck_files_are_refused_with_a_clear_error(local_lm, tmp_path):
    good = bottleneck_for(local_lm).save(tmp_path / "good")
    loaded = PromptAdapter.load(good)
    assert isinstance(loaded, BottleneckAdapter) and loaded.length == 0 and loaded.config.shape == (4, 4, 32)
    cases = [
        ("no-rank", lambda d: _edit_json(d, rank=None), "rank must be a positive integer"),
        ("positions", lambda d: _edit_json(d, prompt_length=4), "adds no positions: prompt_length must be 0"),
        ("rank", lambda d: _edit_json(d, rank=129), "rank 129 is over the limit of 128"),
        ("depth", lambda d: _edit_json(d, num_blocks=3), "a bottleneck for 3 blocks cannot belong"),
        ("shape", lambda d: _edit_json(d, rank=3), r"shape \(4, 4, 32\).*expected \(4, 6, 32\)"),
    ]
    assert_files_refused(local_lm, loaded, tmp_path, cases)


def test_finetune_command_trains_a_bottleneck_through_the_swarm(local_swarm, tiny_model_path, tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", [("1+1=", "2"), ("5+3=", "8")])
    output = tmp_path / "adapter"
    peers = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
    common = ["--model", str(tiny_model_path), "--data", data, "--output", str(output), "--batch-size", "2",
              "--adapter-kind", "bottleneck", "--rank", "2"]
    run_finetune(*common, *peers, "--steps", "2", "--lr", "0.05")
    config = json.loads((output / ADAPTER_CONFIG).read_text())
    assert config["kind"] == "bottleneck" and config["rank"] == 2 and config["prompt_length"] == 0
    assert config["training"]["through_swarm"] is True and config["training"]["steps"] == 2
    trained = PromptAdapter.load(output)
    assert trained.prompts[:, 2:].abs().amax(dim=(1, 2)).min() > 0  # every block's up projection moved from zero
    changed = CliRunner().invoke(finetune_main, [*common[:-1], "3", "--steps", "3"])
    assert changed.exit_code != 0 and "bottleneck adapter of rank 2, not --adapter-kind bottleneck --rank 3" in \
        changed.output


# ----- the head correction -------------------------------------------------------------------------------
def test_a_head_correction_gives_the_same_tokens_locally_and_through_the_swarm(remote_lm, local_lm, tmp_path):
    adapter = bottleneck_for(local_lm, rank=2, seed=6, head_rank=2)
    path = adapter.save(tmp_path / "with-head")
    loaded = PromptAdapter.load(path)
    assert loaded.config.head_rank == 2 and torch.equal(loaded.head_up, adapter.head_up)
    for options in ({}, {"cache": "dual", "cache_refresh": 2}):
        local = local_lm.generate("adapt", adapter=str(path), **GENERATION, **options)
        assert remote_lm.generate("adapt", adapter=str(path), **GENERATION, **options).token_ids == local.token_ids
    headless = BottleneckAdapter(bottleneck_for(local_lm, rank=2, seed=6).config, adapter.prompts.detach())
    without = local_lm.generate("adapt", adapter=str(headless.save(tmp_path / "headless")), **GENERATION).token_ids
    assert local_lm.generate("adapt", adapter=str(path), **GENERATION).token_ids != without  # it changes the text
    zero_up = (adapter.head_down.detach(), torch.zeros_like(adapter.head_up))
    unchanged = BottleneckAdapter(adapter.config, adapter.prompts.detach(), zero_up).save(tmp_path / "zero-up")
    assert remote_lm.generate("adapt", adapter=str(unchanged), **GENERATION).token_ids == without


def test_bad_head_corrections_are_refused_with_a_clear_error(local_lm, tmp_path):
    good = bottleneck_for(local_lm, head_rank=2).save(tmp_path / "good")
    loaded = PromptAdapter.load(good)
    tensors = loaded.tensors()
    cases = [
        ("missing", lambda d: save_file({"prompt": tensors["prompt"]}, str(d / ADAPTER_WEIGHTS)),
         r"must hold exactly the tensors \['head_down', 'head_up', 'prompt'\]"),
        ("shape", lambda d: save_file(dict(tensors, head_up=torch.zeros(7, 2)), str(d / ADAPTER_WEIGHTS)),
         r"head_up has shape \(7, 2\)"),
        ("nan", lambda d: save_file(dict(tensors, head_down=torch.full((2, 32), float("nan"))),
                                    str(d / ADAPTER_WEIGHTS)), "head_down contains NaN"),
        ("rank", lambda d: _edit_json(d, head_rank=129), "head_rank 129 is over the limit of 128"),
        ("vocab", lambda d: _edit_json(d, vocab_size=7), "a head correction for a vocabulary of 7 cannot belong"),
        ("no-vocab", lambda d: _edit_json(d, vocab_size=None), "vocab_size must be a positive integer"),
        ("text-rank", lambda d: _edit_json(d, head_rank="3"), "head_rank must be a positive integer"),
    ]
    assert_files_refused(local_lm, loaded, tmp_path, cases)


def test_finetune_command_trains_a_head_correction(local_swarm, tiny_model_path, tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", [("1+1=", "2"), ("5+3=", "8")])
    output = tmp_path / "adapter"
    common = ["--model", str(tiny_model_path), "--data", data, "--output", str(output), "--batch-size", "2",
              "--adapter-kind", "bottleneck", "--rank", "2", "--head-rank", "3"]
    run_finetune(*common, "--steps", "2", "--lr", "0.05")
    config = json.loads((output / ADAPTER_CONFIG).read_text())
    assert config["head_rank"] == 3 and config["vocab_size"] == 260
    trained = PromptAdapter.load(output)
    assert trained.head_up.abs().max() > 0  # the head correction trained (it starts at zero)
    changed = CliRunner().invoke(finetune_main, [*common[:-1], "0", "--steps", "3"])
    assert changed.exit_code != 0 and "head correction of rank 3, not --head-rank 0" in changed.output


def test_a_bottleneck_run_resumes_whatever_the_unused_prompt_length(tiny_model_path, tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", [("1+1=", "2"), ("5+3=", "8")])
    common = ["--model", str(tiny_model_path), "--data", data, "--output", str(tmp_path / "run"), "--batch-size", "2",
              "--adapter-kind", "bottleneck", "--rank", "2"]
    run_finetune(*common, "--steps", "1", "--prompt-length", "16")
    run_finetune(*common, "--steps", "2", "--prompt-length", "4")  # a prompt length means nothing to a bottleneck
    assert json.loads((tmp_path / "run" / ADAPTER_CONFIG).read_text())["training"]["steps"] == 2
    changed = CliRunner().invoke(finetune_main, [*common, "--steps", "3", "--lr", "0.5"])
    assert changed.exit_code != 0 and "lr: 0.01 -> 0.5" in changed.output


def test_a_server_refuses_nan_bottleneck_weights_naming_them(remote_lm):
    server = holder_of(remote_lm, 0, 2)
    weights = torch.randn(2, 4, 32)
    weights[1, 3, 5] = float("nan")
    parts = request_parts(ForwardRequest(0, 2, torch.randn(1, 5, 32), adapter=BlockAdapter(BOTTLENECK, weights)))
    with pytest.raises(RemoteError, match="bottleneck weights contain NaN") as refused:
        raw_call(remote_lm, server, parts)
    assert refused.value.code == ErrorCode.NOT_FINITE


def test_a_server_that_does_not_list_bottlenecks_is_never_sent_one(local_swarm, tiny_model_path, local_lm, remote_lm,
                                                                   tmp_path):
    """The attack (or just an old version): a server whose record lists no per-block adapter kinds and whose blocks
    add any per-block tensor as a deep prompt (tests/old_server.py). It answers a bottleneck wrongly without an
    error, so the client sends bottlenecks only to servers that list the kind: the tokens stay the local ones, plain
    passes still use that server, and with no other server left a bottleneck pass says what is missing.

    On the shared swarm, under a prefix of its own (the tiny model's files copied to a folder of another name: the
    same weights, so the local model's tokens hold, and none of the shared servers, so that the last one that applies
    bottlenecks can leave): a swarm of its own cost a fork server and a bootstrap peer, ~3.5 CPU s. Its client joins
    through the session client's DHT peer (``dht=``): which peer reads the records is not the point, and a DHT of its
    own is a DHT process and a libp2p daemon, ~0.6 CPU s."""
    from swarm.client import DistributedDiffusionLM
    from swarm.client.routing import MissingBlocksError

    adapter = bottleneck_for(local_lm)
    path = str(adapter.save(tmp_path / "bottleneck"))
    model = shutil.copytree(tiny_model_path, tmp_path / "bottleneck-old-server")
    old, honest = start_all(local_swarm, model, [("0:4", (), OLD_SERVER), ("0:4", ())])
    lm = DistributedDiffusionLM.from_pretrained(model, dht=remote_lm.dht, request_timeout=10)
    try:
        hidden = torch.randn(1, 6, local_lm.config.hidden_size, generator=torch.Generator().manual_seed(0))
        weights = adapter.prompts.detach()
        request = ForwardRequest(0, 4, hidden, "probe", -1, adapter=BlockAdapter(BOTTLENECK, weights))
        answers = {server.peer_id: lm.loop.run(lm.caller.forward(server.peer_id, request, 30))
                   for server in (old, honest)}
        expected = local_lm.model.span(hidden, adapter=BlockAdapter(BOTTLENECK, weights))
        assert torch.allclose(answers[honest.peer_id], expected, atol=1e-4)
        assert not torch.allclose(answers[old.peer_id], expected, atol=1e-2)  # the danger is real

        for seed in range(3):
            assert (lm.generate("adapt", adapter=path, seed=seed, **GENERATION).token_ids
                    == local_lm.generate("adapt", adapter=path, seed=seed, **GENERATION).token_ids)
        local_swarm.terminate(honest)  # it leaves (announces OFFLINE)
        assert lm.generate("adapt", **GENERATION).token_ids == local_lm.generate("adapt", **GENERATION).token_ids
        with pytest.raises(MissingBlocksError, match="no online server that applies bottleneck adapters holds "
                                                     "blocks 0:4"):
            lm.generate("adapt", adapter=path, **GENERATION)
    finally:
        lm.shutdown()
        stop_all(local_swarm, [old, honest])  # their own prefix
