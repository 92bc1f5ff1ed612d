"""An adapter's tensor travels to each server once and is named by digest after that.

A server keeps what it received under its own hash of the bytes (bounded overall and per peer) and says so; the
client names it on later calls, sends it again when the server no longer has it, and gets the same gradients and
tokens as when it sends it every time. Attacks: naming a digest one never sent, naming a held tensor as another
kind or shape, claiming a digest for other bytes, a malformed digest; a flood of uploads by one peer.
"""
from __future__ import annotations

import pytest
import torch

from swarm.adapters.block import BlockAdapter
from swarm.adapters.kinds import BOTTLENECK, LORA
from swarm.adapters.lora import BlockWidths
from swarm.server.adapter_tensors import ENTRY_OVERHEAD_BYTES, AdapterTensors
from swarm.wire.encoding import request_parts
from swarm.wire.messages import ErrorCode, ForwardRequest, RemoteError
from tests.conftest import holder_of, make_checkpoint, stop_all, tiny_config
from tests.test_deep_prompt import _set_metadata, adapter_gradient, raw_call
from tests.test_finetune import GENERATION, TOLERANCE
from tests.test_lora import lora_for


# ----- the store, without a network ---------------------------------------------------------------------
def test_the_store_is_bounded_overall_and_per_peer():
    tensor = torch.zeros(10, 25)  # 1000 bytes
    size = 1000 + ENTRY_OVERHEAD_BYTES
    store = AdapterTensors(max_bytes=4 * size, peer_share=0.5)
    assert store.put("a1", BlockAdapter(LORA, tensor), "alice") and store.put("b1", BlockAdapter(LORA, tensor), "bob")
    for i in range(5):  # a flood by one peer evicts its own oldest uploads, never bob's
        assert store.put(f"m{i}", BlockAdapter(LORA, tensor), "mallory")
    assert {digest for _, digest in store.entries} == {"a1", "b1", "m3", "m4"}
    assert store.peer_bytes["mallory"] == 2 * size
    assert store.get("b1", "bob").kind == LORA and store.get("m0", "mallory") is None
    assert store.put("a2", BlockAdapter(LORA, tensor), "alice")  # over the total: the least recently used (a1) goes
    assert ("alice", "a1") not in store.entries and store.bytes == 4 * size
    assert not store.put("huge", BlockAdapter(LORA, torch.zeros(10, 100)), "alice"), "over a peer's share: not kept"
    assert store.info()["refused"] == 1 and store.info()["hits"] == 1 and store.info()["misses"] == 1
    with pytest.raises(ValueError):
        AdapterTensors(max_bytes=10, peer_share=0.0)
    assert not AdapterTensors(0).enabled


def test_a_digest_names_exactly_the_kind_shape_and_bytes():
    weights = torch.randn(2, 6, 8)
    digest = BlockAdapter(LORA, weights).digest()
    assert digest == BlockAdapter(LORA, weights.clone()).digest() and len(digest) == 64
    changed = weights.clone()
    changed[1, 5, 7] += 1e-6
    others = {BlockAdapter(LORA, changed).digest(), BlockAdapter(BOTTLENECK, weights).digest(),
              BlockAdapter(LORA, weights.reshape(2, 8, 6)).digest(), BlockAdapter(LORA, weights[:1]).digest()}
    assert digest not in others and len(others) == 4


# ----- through the swarm ----------------------------------------------------------------------------------
@pytest.fixture
def fresh_caller(remote_lm):
    """The session client's caller with nothing remembered, its setting restored after the test."""
    caller = remote_lm.caller
    caller.adapters_held.clear()
    yield caller
    caller.adapter_by_digest = True
    caller.adapters_held.clear()


def measured_gradient(lm, tmp_path, adapter, by_digest: bool) -> tuple[float, torch.Tensor, int]:
    lm.caller.adapter_by_digest = by_digest
    sent = lm.caller.bytes_sent
    loss, grad = adapter_gradient(lm, tmp_path, adapter)
    return loss, grad, lm.caller.bytes_sent - sent


def test_a_lora_travels_once_and_gives_the_same_gradients_and_tokens(swarm_peer, tiny_model_path, local_lm,
                                                                      tmp_path):
    from swarm.client import DistributedDiffusionLM

    adapter = lora_for(local_lm, rank=3, seed=7)
    local_loss, local_grad = adapter_gradient(local_lm, tmp_path, adapter)
    # Its own client, whose route stays put (a route rebuilt between the passes could reach a server that has
    # not seen the tensor yet, which would rightly cost an upload and blur the byte counts).
    with DistributedDiffusionLM.from_pretrained(tiny_model_path, dht=swarm_peer, route_refresh=3600.0,
                                                request_timeout=20) as lm:
        every_loss, every_grad, every_bytes = measured_gradient(lm, tmp_path, adapter, by_digest=False)
        assert not lm.caller.adapters_held
        first_loss, first_grad, first_bytes = measured_gradient(lm, tmp_path, adapter, by_digest=True)
        again_loss, again_grad, again_bytes = measured_gradient(lm, tmp_path, adapter, by_digest=True)
        for loss, grad in ((every_loss, every_grad), (first_loss, first_grad), (again_loss, again_grad)):
            assert loss == pytest.approx(local_loss, abs=1e-6)
            assert (grad - local_grad).abs().max().item() <= TOLERANCE
        tensor_bytes = adapter.prompts.numel() * 4  # every block's slice, once per pass
        # Sent every time: forward and backward each carry it. Named: the forward sends it, the backward names it;
        # the next step names it both ways.
        assert every_bytes - first_bytes >= 0.9 * tensor_bytes, (every_bytes, first_bytes, tensor_bytes)
        assert every_bytes - again_bytes >= 1.8 * tensor_bytes, (every_bytes, again_bytes, tensor_bytes)
        hops = {(hop.peer_id, hop.start, hop.end) for hop in lm.planner.route}
        assert len(lm.caller.adapters_held) >= len(hops) and lm.caller.adapter_misses == 0
        info, _ = lm.loop.run(lm.caller.info(next(iter(hops))[0], 10))
        assert info["adapter_tensors"]["hits"] >= 2 and info["adapter_tensors"]["entries"] >= 1

        path = str(adapter.save(tmp_path / "lora"))
        sent = lm.caller.bytes_sent
        swarm = lm.generate("named", adapter=path, **GENERATION)
        assert swarm.token_ids == local_lm.generate("named", adapter=path, **GENERATION).token_ids
        per_step = (lm.caller.bytes_sent - sent) / GENERATION["steps"]
        assert per_step < tensor_bytes, "after its first step a generation names the tensor instead of sending it"


def test_a_tensor_the_server_no_longer_holds_is_sent_again(local_swarm, remote_lm, local_lm, fresh_caller,
                                                           tmp_path):
    """As after an eviction or a restart: the client believes servers hold a tensor they never received."""
    adapter = lora_for(local_lm, rank=2, seed=11)
    local_loss, local_grad = adapter_gradient(local_lm, tmp_path, adapter)
    for server in (p for p in local_swarm.processes if p.alive and p.span):  # every hop any route could take
        first, last = server.span
        for start in range(first, last):
            for end in range(start + 1, last + 1):
                digest = BlockAdapter(LORA, adapter.prompts.detach()[start:end]).digest()
                fresh_caller.adapters_held[server.peer_id, digest] = None
    loss, grad = adapter_gradient(remote_lm, tmp_path, adapter)
    assert loss == pytest.approx(local_loss, abs=1e-6)
    assert (grad - local_grad).abs().max().item() <= TOLERANCE
    assert fresh_caller.adapter_misses >= 1


def named_request(hidden: torch.Tensor, weights: torch.Tensor, kind: str = LORA, digest: str | None = None):
    """The parts of a request that names ``weights`` by ``digest`` (theirs by default) instead of sending them."""
    digest = digest or BlockAdapter(kind, weights).digest()
    return request_parts(ForwardRequest(0, 2, hidden, adapter=BlockAdapter(kind, weights), adapter_digest=digest))


def test_naming_what_one_never_sent_or_another_shape_or_kind_is_refused(remote_lm, local_lm):
    server = holder_of(remote_lm, 0, 2)
    widths = BlockWidths.of(local_lm.config)
    hidden = torch.randn(1, 5, 32)
    weights = 0.3 * torch.randn(2, widths.rows(2), 32, generator=torch.Generator().manual_seed(4))
    with pytest.raises(RemoteError, match="no adapter tensor .* never sent to this server") as missing:
        raw_call(remote_lm, server, named_request(hidden, weights))
    assert missing.value.code == ErrorCode.ADAPTER_MISS

    adapter = BlockAdapter(LORA, weights)

    _, answer = raw_call(remote_lm, server, request_parts(ForwardRequest(0, 2, hidden, adapter=adapter)))
    assert answer.get("prompt_held") is True
    output, _ = raw_call(remote_lm, server, named_request(hidden, weights))
    with torch.no_grad():
        expected = local_lm.model.span(hidden, blocks=(0, 2), adapter=BlockAdapter(LORA, weights))
    assert (output - expected).abs().max().item() <= TOLERANCE

    digest = BlockAdapter(LORA, weights).digest()
    wider = torch.zeros(2, widths.rows(3), 32)
    cases = [
        (named_request(hidden, wider, digest=digest), ErrorCode.BAD_REQUEST, "the request declares a lora of"),
        (named_request(hidden, weights, BOTTLENECK, digest=digest), ErrorCode.BAD_REQUEST,
         "is a lora .* the request declares a bottleneck"),
        (named_request(hidden, weights, digest="ab" * 31), ErrorCode.BAD_REQUEST, "64 lowercase hex digits"),
        (named_request(hidden, weights, digest=digest.upper()), ErrorCode.BAD_REQUEST, "64 lowercase hex digits"),
    ]
    other = 0.3 * torch.randn(2, widths.rows(2), 32)
    both = request_parts(ForwardRequest(0, 2, hidden, adapter=BlockAdapter(LORA, other)))  # other's bytes ...
    _set_metadata(both[0], prompt_digest=digest)  # ... filed under the held tensor's digest
    cases.append((both, ErrorCode.BAD_REQUEST, "either sends its adapter tensor .* or names it"))
    for parts, code, message in cases:
        with pytest.raises(RemoteError, match=message) as refused:
            raw_call(remote_lm, server, parts)
        assert refused.value.code == code
    # Nothing above replaced or harmed the held tensor, and the server goes on.
    output, _ = raw_call(remote_lm, server, named_request(hidden, weights))
    assert (output - expected).abs().max().item() <= TOLERANCE
    with pytest.raises(RemoteError) as missing:
        raw_call(remote_lm, server, named_request(hidden, other))
    assert missing.value.code == ErrorCode.ADAPTER_MISS


def test_a_server_that_keeps_no_adapter_tensors_gets_them_every_time(local_swarm, local_lm, tmp_path, swarm_peer):
    """--adapter-memory-mb 0: the server never says it holds a tensor, so the client always sends it."""
    from swarm.client import DistributedDiffusionLM

    path = make_checkpoint(tmp_path / "keeps_none", tiny_config(), seed=0)  # the same weights, its own prefix
    server = local_swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--adapter-memory-mb", "0")
    adapter = lora_for(local_lm, rank=2, seed=3)
    try:
        with DistributedDiffusionLM.from_pretrained(path, dht=swarm_peer) as lm:
            local_loss, local_grad = adapter_gradient(local_lm, tmp_path, adapter)
            for _ in range(2):
                loss, grad = adapter_gradient(lm, tmp_path, adapter)
                assert loss == pytest.approx(local_loss, abs=1e-6)
                assert (grad - local_grad).abs().max().item() <= TOLERANCE
            assert not lm.caller.adapters_held and lm.caller.adapter_misses == 0
            info, _ = lm.loop.run(lm.caller.info(server.peer_id, 10))
            assert info["adapter_tensors"]["max_bytes"] == 0 and info["adapter_tensors"]["entries"] == 0
    finally:
        stop_all(local_swarm, [server])  # its own prefix

