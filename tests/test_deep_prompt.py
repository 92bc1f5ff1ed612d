"""Deep prompts (issue 19, item 5's adapter): vectors per block, carried by every forward and backward request.

Gradients of the deep prompt through real servers equal local autograd (float32); a deep adapter gives the same
tokens locally and through the swarm, in every mode that can carry it; servers refuse malformed prompt tensors
with clear codes and go on serving; bad adapter files are refused; a server killed mid-backward is replaced.
"""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.asyncio import iter_as_aiter
from safetensors.torch import save_file

from swarm.adapters.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterConfig,
    AdapterError,
    DeepPrompt,
    PromptAdapter,
    SoftPrompt,
    base_of,
)
from swarm.adapters.block import BlockAdapter
from swarm.adapters.kinds import DEEP_PROMPT
from swarm.adapters.lora import BlockWidths
from swarm.finetune.__main__ import main as finetune_main
from swarm.finetune.data import load_examples, make_batch
from swarm.finetune.trainer import sft_loss
from swarm.server.validation import validate_prompt_declared
from swarm.wire.encoding import (
    MAX_UNARY_BYTES,
    collect_response,
    decode_tensor,
    join_parts,
    parse_metadata,
    request_parts,
    response_parts,
    split_parts,
)
from swarm.wire.messages import BackwardRequest, ErrorCode, ForwardRequest, PushSpec, RemoteError
from swarm.wire.remote import read_stream
from tests.conftest import holder_of, wait_seen
from tests.test_adapter_sharing import served_and_published
from tests.test_finetune import (
    GENERATION,
    TOLERANCE,
    client,
    fast_server,
    kill_before_its_backward,
    run_finetune,
    write_pairs,
)

WIDTHS = BlockWidths(32, 4, 2, 64)  # a model's projection widths (hidden, heads, kv heads, MLP)


def deep_adapter_for(lm, length: int = 3, seed: int = 0, scale: float = 0.5) -> DeepPrompt:
    """Random vectors for every block (block 0's at the embeddings' scale, the others smaller)."""
    config = AdapterConfig(length, lm.config.hidden_size, base_of(lm.config, lm.tokenizer), DEEP_PROMPT,
                           num_blocks=lm.config.num_layers)
    prompts = torch.randn(config.shape, generator=torch.Generator().manual_seed(seed))
    prompts[1:] *= scale
    return DeepPrompt(config, prompts)


def adapter_gradient(lm, tmp_path, adapter: PromptAdapter) -> tuple[float, torch.Tensor]:
    """The SFT loss of a fixed batch and its gradient with respect to the adapter's main tensor (every block's
    slice, for a per-block kind)."""
    examples = load_examples(write_pairs(tmp_path / "pairs.jsonl", [("12+7=", "19"), ("hello ", "world!")]),
                             lm.tokenizer, lm.config.eos_token_id)
    adapter = type(adapter)(adapter.config, adapter.prompts.detach())
    loss = sft_loss(lm.backbone(), adapter, make_batch(examples, lm.config.eos_token_id),
                    torch.Generator().manual_seed(3))
    loss.backward()
    return loss.item(), adapter.prompts.grad


# ----- gradients ---------------------------------------------------------------------------------------
def test_deep_prompt_gradients_through_the_swarm_equal_local_autograd(remote_lm, local_lm, tmp_path):
    adapter = deep_adapter_for(local_lm)
    local_loss, local_grad = adapter_gradient(local_lm, tmp_path, adapter)
    remote_lm.sequence.failovers.clear()
    swarm_loss, swarm_grad = adapter_gradient(remote_lm, tmp_path, adapter)
    assert len({hop.peer_id for hop in remote_lm.planner.route}) >= 2  # the prompt is split between servers
    assert all(local_grad[block].abs().max() > 1e-4 for block in range(local_lm.config.num_layers))
    assert swarm_loss == pytest.approx(local_loss, abs=1e-6)
    assert (swarm_grad - local_grad).abs().max().item() <= TOLERANCE


def test_a_server_killed_mid_backward_is_replaced_with_the_same_deep_prompt_gradients(local_swarm, tiny_model_path,
                                                                                     local_lm, tmp_path, swarm_peer):
    victim = fast_server(local_swarm, tiny_model_path, "0:2")
    lm = client(local_swarm, tiny_model_path, dht=swarm_peer)
    wait_seen(lm, [victim])  # the route holds the victim
    calls = kill_before_its_backward(local_swarm, lm, victim)
    try:
        adapter = deep_adapter_for(local_lm, seed=1)
        _, swarm_grad = adapter_gradient(lm, tmp_path, adapter)
        _, local_grad = adapter_gradient(local_lm, tmp_path, adapter)
        assert calls.count(victim.peer_id) == 1, calls  # called once, dead by then: a replica answered instead
        assert (swarm_grad - local_grad).abs().max().item() <= TOLERANCE
    finally:
        lm.shutdown()


# ----- tokens ------------------------------------------------------------------------------------------
def test_a_deep_prompt_gives_the_same_tokens_locally_and_through_the_swarm(local_swarm, tiny_model_path, remote_lm,
                                                                          local_lm, tmp_path, caplog, swarm_peer):
    deep = deep_adapter_for(local_lm, length=4, seed=5)
    path = deep.save(tmp_path / "deep")
    for options in ({}, {"cache": "dual", "cache_refresh": 2}, {"remasking": "random", "parallel_window": 2}):
        local = local_lm.generate("adapt", adapter=str(path), **GENERATION, **options)
        swarm = remote_lm.generate("adapt", adapter=str(path), **GENERATION, **options)
        assert swarm.token_ids == local.token_ids, options
    pushing = client(local_swarm, tiny_model_path, push=True, dht=swarm_peer)
    try:
        with caplog.at_level("INFO", logger="swarm.client.sequence"):
            pushed = pushing.generate("adapt", adapter=str(path), **GENERATION)
        assert pushed.token_ids == local_lm.generate("adapt", adapter=str(path), **GENERATION).token_ids
        assert "push is off for passes with a deep prompt" in caplog.text
    finally:
        pushing.shutdown()
    # the per-block vectors matter: the same first-block vectors as a soft prompt give other tokens ...
    soft_config = AdapterConfig(4, local_lm.config.hidden_size, deep.config.base)
    soft = SoftPrompt(soft_config, deep.prompts[0]).save(tmp_path / "soft")
    deep_tokens = local_lm.generate("adapt", adapter=str(path), **GENERATION).token_ids
    assert local_lm.generate("adapt", adapter=str(soft), **GENERATION).token_ids != deep_tokens
    # ... and a deep prompt whose other blocks' vectors are zero is exactly that soft prompt
    zeros = deep.prompts.detach().clone()
    zeros[1:] = 0
    flat = DeepPrompt(deep.config, zeros).save(tmp_path / "flat")
    assert (remote_lm.generate("adapt", adapter=str(flat), **GENERATION).token_ids
            == local_lm.generate("adapt", adapter=str(soft), **GENERATION).token_ids)


# ----- hostile prompt tensors ------------------------------------------------------------------------
def raw_call(lm, peer: str, parts: list[runtime_pb2.ExpertRequest], backward: bool = False):
    """Send request parts as any peer could (nothing checked on this side); the answer's tensor and metadata."""
    stub = lm.caller._stub(peer)
    unary, stream = ((stub.rpc_backward, stub.rpc_backward_stream) if backward
                     else (stub.rpc_forward, stub.rpc_forward_stream))

    async def rpc() -> list:
        if len(parts) == 1:
            return [await unary(parts[0])]
        return await read_stream(stream(iter_as_aiter(parts)))

    return lm.loop.run(lm.caller._call(peer, rpc, 10, collect_response))


def _set_metadata(part: runtime_pb2.ExpertRequest, **changes) -> None:
    part.metadata = MSGPackSerializer.dumps(dict(MSGPackSerializer.loads(part.metadata), **changes))


@pytest.mark.parametrize("case, code, message", [
    ("shape", ErrorCode.BAD_REQUEST, r"shape \(2, 4, 32\), the request declares \(2, 3, 32\)"),
    ("blocks", ErrorCode.BAD_REQUEST, r"shape \(1, 3, 32\), the request declares \(2, 3, 32\)"),
    ("nan", ErrorCode.NOT_FINITE, "deep prompt vectors contain NaN"),
    ("dtype", ErrorCode.BAD_REQUEST, "deep prompt vectors must be float32/float16/bfloat16, got torch.int64"),
    ("oversized", ErrorCode.TOO_LARGE, "over the"),
    ("length", ErrorCode.BAD_REQUEST, r"'prompt_length' must be an integer in 1\.\.256"),
    ("parts", ErrorCode.BAD_REQUEST, "'prompt_parts' must be a positive integer"),
    ("push", ErrorCode.BAD_REQUEST, "a pushed request cannot carry a deep prompt"),
    ("backward-nan", ErrorCode.NOT_FINITE, "deep prompt vectors contain NaN"),
])
def test_servers_refuse_malformed_deep_prompts(remote_lm, local_lm, case, code, message):
    server = holder_of(remote_lm, 0, 2)
    hidden, prompts = torch.randn(1, 5, 32), torch.randn(2, 3, 32)
    backward = case.startswith("backward")
    if case == "shape":
        prompts = torch.randn(2, 4, 32)
    elif case == "blocks":
        prompts = torch.randn(1, 3, 32)
    elif case in ("nan", "backward-nan"):
        prompts[1, 2, 7] = float("nan")
    elif case == "oversized":
        prompts = torch.randn(2, 400, 32)  # 100 KiB where 3 vectors per block are declared
    request = ForwardRequest(0, 2, torch.cat([hidden, hidden]) if backward else hidden,
                             adapter=BlockAdapter(DEEP_PROMPT, prompts))
    if case == "push":
        request.push = PushSpec((), "x", "x", "x")
    parts = request_parts(request, uid="backward" if backward else "forward")
    if case in ("shape", "oversized"):
        _set_metadata(parts[0], prompt_length=3)
    elif case == "dtype":
        parts[0].tensors[1].CopyFrom(serialize_torch_tensor(torch.zeros(2, 3, 32, dtype=torch.int64)))
    elif case == "length":
        _set_metadata(parts[0], prompt_length=257)
    elif case == "parts":
        _set_metadata(parts[0], prompt_parts=0)
    with pytest.raises(RemoteError, match=message) as refused:
        raw_call(remote_lm, server, parts, backward)
    assert refused.value.code == code
    # the server still answers a good request, with the local model's numbers
    prompts = torch.randn(2, 3, 32)
    adapter = BlockAdapter(DEEP_PROMPT, prompts)
    output, _ = raw_call(remote_lm, server, request_parts(ForwardRequest(0, 2, hidden, adapter=adapter)))
    with torch.no_grad():
        expected = local_lm.model.span(hidden, blocks=(0, 2), adapter=adapter)
    assert (output - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("length", [5, 3000])  # one unary message; a stream of parts (over 1 MiB)
def test_deep_prompts_and_their_gradients_cross_the_wire_intact(length):
    hidden, prompts = torch.randn(1, length, 128), torch.randn(8, 16, 128)
    parts = request_parts(ForwardRequest(0, 8, hidden, adapter=BlockAdapter(DEEP_PROMPT, prompts)))
    assert (len(parts) == 1) == (length == 5) and all(p.ByteSize() <= MAX_UNARY_BYTES + 4096 for p in parts)
    metadata = parse_metadata(parts[0].metadata)
    tensors = [t for part in parts for t in part.tensors]
    main, second = split_parts(tensors, metadata["parts"], metadata["prompt_parts"])
    assert metadata["prompt_length"] == 16
    assert torch.equal(decode_tensor(join_parts(main, metadata["parts"])), hidden)
    assert torch.equal(decode_tensor(join_parts(second, metadata["prompt_parts"])), prompts)
    answer, answer_metadata = collect_response(response_parts(hidden, "auto", second=prompts))
    assert torch.equal(answer, hidden) and torch.equal(answer_metadata["prompts"], prompts)
    with pytest.raises(RemoteError, match="stream ended after|empty response") as cut:
        collect_response(response_parts(hidden, "auto", second=prompts)[:-1] if length > 5 else [])
    assert cut.value.code == ErrorCode.INCOMPLETE


def test_a_deep_prompt_for_more_positions_than_a_server_takes_is_refused_before_receiving():
    assert validate_prompt_declared({}, 4, 100, WIDTHS) == (0, 0, DEEP_PROMPT)
    assert validate_prompt_declared({"prompt_length": 16, "prompt_parts": 1}, 4, 100, WIDTHS) == (16, 1, DEEP_PROMPT)
    with pytest.raises(RemoteError, match="exceeds this server's limit of 100") as refused:
        validate_prompt_declared({"prompt_length": 30, "prompt_parts": 1}, 4, 100, WIDTHS)
    assert refused.value.code == ErrorCode.TOO_LARGE


# ----- adapter files -----------------------------------------------------------------------------------
def _edit_json(directory, **changes) -> None:
    path = directory / ADAPTER_CONFIG
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **changes)))


def test_bad_deep_prompt_files_are_refused_with_a_clear_error(local_lm, tmp_path):
    good = deep_adapter_for(local_lm).save(tmp_path / "good")
    assert isinstance(PromptAdapter.load(good), DeepPrompt)
    cases = [
        ("no-blocks", lambda d: _edit_json(d, num_blocks=None), "num_blocks must be a positive integer"),
        ("depth", lambda d: _edit_json(d, num_blocks=3), "a deep prompt for 3 blocks cannot belong to a base model "
                                                         "of 4 blocks"),
        ("flat", lambda d: save_file({"prompt": torch.zeros(3, 32)}, str(d / ADAPTER_WEIGHTS)),
         r"shape \(3, 32\).*expected \(4, 3, 32\)"),
        ("nan", lambda d: save_file({"prompt": torch.full((4, 3, 32), float("nan"))}, str(d / ADAPTER_WEIGHTS)),
         "NaN"),
        ("huge", lambda d: _edit_json(d, num_blocks=4000, prompt_length=256, hidden_size=32), "over the limit"),
        ("kind", lambda d: _edit_json(d, kind="deep"), "unknown adapter kind"),
    ]
    assert_files_refused(local_lm, PromptAdapter.load(good), tmp_path, cases)


def assert_files_refused(lm, adapter: PromptAdapter, tmp_path, cases) -> None:
    """Each case (name, edit of a saved copy of ``adapter``, message): generating with the edited copy is refused
    with an :class:`AdapterError` matching the message."""
    for name, edit, message in cases:
        directory = adapter.save(tmp_path / name)
        edit(directory)
        with pytest.raises(AdapterError, match=message):
            lm.generate("x", adapter=str(directory), gen_length=8, steps=2, block_length=8)


# ----- the command and sharing ---------------------------------------------------------------------------
def test_finetune_command_trains_a_deep_prompt_through_the_swarm(local_swarm, tiny_model_path, local_lm, tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", [("1+1=", "2"), ("5+3=", "8")])
    output = tmp_path / "adapter"
    peers = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
    common = ["--model", str(tiny_model_path), "--data", data, "--output", str(output), "--batch-size", "2",
              "--prompt-length", "3"]
    run_finetune(*common, *peers, "--steps", "2", "--adapter-kind", "deep_prompt")
    config = json.loads((output / ADAPTER_CONFIG).read_text())
    assert config["kind"] == "deep_prompt" and config["num_blocks"] == 4
    assert config["training"]["through_swarm"] is True and config["training"]["steps"] == 2
    trained = PromptAdapter.load(output)
    assert trained.prompts[1:].abs().max() > 0  # every block's vectors moved from zero
    changed = CliRunner().invoke(finetune_main, [*common, "--steps", "3"])
    assert changed.exit_code != 0 and "not --adapter-kind soft_prompt" in changed.output


def test_a_published_deep_prompt_is_used_by_name(local_swarm, remote_lm, local_lm, tiny_model_path, tmp_path,
                                                 monkeypatch):
    monkeypatch.setattr(remote_lm, "adapter_cache", tmp_path / "cache")
    directory = deep_adapter_for(local_lm, seed=7).save(tmp_path / "adapter")
    with served_and_published(local_swarm, tiny_model_path, directory, "deep-one", tmp_path):
        by_name = remote_lm.generate("adapt", adapter="deep-one", **GENERATION)
        assert by_name.token_ids == local_lm.generate("adapt", adapter=str(directory), **GENERATION).token_ids


def test_responses_are_padded_to_the_generation_length_when_asked(local_lm, tmp_path):
    examples = load_examples(write_pairs(tmp_path / "pairs.jsonl", [("1+1=", "2"), ("10+10=", "20")]),
                             local_lm.tokenizer, local_lm.config.eos_token_id)
    plain = make_batch(examples, local_lm.config.eos_token_id)
    padded = make_batch(examples, local_lm.config.eos_token_id, pad_response=8)
    assert plain.tokens.shape[1] == len(examples[1].prompt) + len(examples[1].response)
    assert padded.tokens.shape[1] == len(examples[1].prompt) + 8
    assert padded.answer_lengths.tolist() == [padded.tokens.shape[1] - len(e.prompt) for e in examples]
    assert bool((padded.tokens[:, plain.tokens.shape[1]:] == local_lm.config.eos_token_id).all())


@pytest.mark.parametrize("lie, message", [
    ("shape", r"a gradient of shape \(1, 4, 32\), expected \(1, 5, 32\)"),
    ("nan", "a gradient with NaN or infinite values"),
    ("missing", "answered no gradient for the deep prompt"),
    ("prompt-shape", r"a deep prompt gradient of shape \(2, 2, 32\), expected \(2, 3, 32\)"),
    ("prompt-nan", "a deep prompt gradient with NaN or infinite values"),
    ("unasked", "a deep prompt gradient it was not asked for"),
])
def test_a_lying_backward_answer_is_refused(remote_lm, monkeypatch, lie, message):
    """A server's backward answer, in real wire messages, that lies about either gradient is refused by the client
    before it reaches the optimiser (the failover loop then asks a replica)."""
    inputs, prompts = torch.randn(1, 5, 32), torch.randn(2, 3, 32)
    grad, grad_prompts = torch.randn(1, 5, 32), torch.randn(2, 3, 32)
    if lie == "shape":
        grad = torch.randn(1, 4, 32)
    elif lie == "nan":
        grad[0, 1, 2] = float("nan")
    elif lie == "missing":
        grad_prompts = None
    elif lie == "prompt-shape":
        grad_prompts = torch.randn(2, 2, 32)
    elif lie == "prompt-nan":
        grad_prompts[1, 0, 0] = float("inf")
    asked = None if lie == "unasked" else BlockAdapter(DEEP_PROMPT, prompts)
    answer = response_parts(grad, "auto", second=grad_prompts)

    def lying_rpc(*args, **kwargs):
        async def rpc() -> list:
            return answer
        return rpc

    monkeypatch.setattr(remote_lm.caller, "_forward_rpc", lying_rpc)
    request = BackwardRequest(0, 2, inputs, torch.randn(1, 5, 32), adapter=asked)
    with pytest.raises(RemoteError, match=message) as refused:
        remote_lm.loop.run(remote_lm.caller.backward_all("QmLiar", request, 10))
    assert refused.value.code == ErrorCode.INTERNAL
