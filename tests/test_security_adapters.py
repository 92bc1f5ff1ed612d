"""Hostile peers and servers against adapter tensors named by digest (issue 33, item 6).

A stranger who has an adapter's bytes asks a server whether somebody uses it, re-uploads a victim's bytes and
floods its own share; a server says it keeps every tensor and never has it. Each runs against real server
processes and fails when its defence (entries per peer, a caller's own info only, the client's score of broken
``prompt_held`` claims) is removed.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.adapters.block import BlockAdapter
from swarm.adapters.kinds import LORA
from swarm.adapters.lora import BlockWidths
from swarm.server.adapter_tensors import ENTRY_OVERHEAD_BYTES, AdapterTensors
from swarm.wire.encoding import request_parts
from swarm.wire.messages import ErrorCode, ForwardRequest, RemoteError
from tests.conftest import make_checkpoint, stop_all, tiny_config
from tests.test_finetune import GENERATION, TOLERANCE
from tests.test_lora import lora_for


def test_each_peer_finds_only_its_own_uploads():
    """Naming a digest finds nothing of another peer's; uploading its bytes makes the uploader a copy of its
    own, which the uploader's flood then evicts without touching the original; info shows a peer its own only."""
    tensor = torch.zeros(10, 25)
    size = 1000 + ENTRY_OVERHEAD_BYTES
    store = AdapterTensors(max_bytes=8 * size, peer_share=0.5)
    assert store.put("secret", BlockAdapter(LORA, tensor), "victim")
    assert store.get("secret", "mallory") is None, "a digest told mallory the victim's adapter is in use"
    assert store.put("secret", BlockAdapter(LORA, tensor), "mallory")
    for i in range(8):
        store.put(f"flood{i}", BlockAdapter(LORA, tensor), "mallory")
    assert store.get("secret", "victim") is not None, "mallory's upload and flood took the victim's entry"
    assert store.info("mallory") == {"max_bytes": 8 * size, "max_peer_bytes": 4 * size, "entries": 4,
                                     "bytes": 4 * size, "hits": 0}
    assert store.info("victim")["hits"] == 1 and store.info("nobody")["entries"] == 0
    assert store.info()["misses"] == 1 and store.info()["entries"] == 5  # the operator's view: everything


# ----- hostile peers and servers (issue 33, item 6) ---------------------------------------------------------
FORGETFUL = (str(Path(__file__).with_name("forgetful_server.py")),)


@pytest.fixture(scope="module")
def small_stores(local_swarm, tmp_path_factory):
    """Two servers of blocks 0:4 with 1 MiB of adapter memory (0.5 MiB a peer), each under its own prefix: an
    honest one, and one that says it keeps every tensor and never has it."""
    servers = {}
    for name, entry in (("honest", ("-m", "swarm.server")), ("forgetful", FORGETFUL)):
        path = make_checkpoint(tmp_path_factory.mktemp(name) / f"small-{name}", tiny_config(), seed=0)
        servers[name] = (path, local_swarm.start_server(str(path), "0:4", "--compute-threads", "1",
                                                        "--adapter-memory-mb", "1", entry=entry, wait=False))
    for _, server in servers.values():
        local_swarm.wait_ready(server)
    yield servers
    stop_all(local_swarm, [server for _, server in servers.values()])  # their own prefixes


def lora_request(weights: torch.Tensor, digest: str | None = None):
    hidden = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(1))
    return request_parts(ForwardRequest(0, 2, hidden, adapter=BlockAdapter(LORA, weights), adapter_digest=digest))


def test_a_digest_tells_a_stranger_nothing_and_cannot_be_taken_over(small_stores, local_lm):
    from tests.test_security_server import Peer

    server = small_stores["honest"][1]
    rows = BlockWidths.of(local_lm.config).rows(32)  # 128 KiB a tensor: four fill a peer's share
    secret = 0.3 * torch.randn(2, rows, 32, generator=torch.Generator().manual_seed(5))
    digest = BlockAdapter(LORA, secret).digest()
    victim, stranger = Peer(server), Peer(server)
    try:
        assert victim.stream(lora_request(secret))[1].get("prompt_held") is True
        with pytest.raises(RemoteError) as probed:  # the stranger has the bytes and asks whether it is in use
            stranger.stream(lora_request(secret, digest))
        assert probed.value.code == ErrorCode.ADAPTER_MISS
        seen = stranger.info()["adapter_tensors"]
        assert seen["entries"] == 0 and seen["bytes"] == 0 and "misses" not in seen and "stored" not in seen
        assert stranger.stream(lora_request(secret))[1].get("prompt_held") is True  # a copy of its own
        for seed in range(6):  # then a flood past its share, which evicts its own oldest uploads
            stranger.stream(lora_request(torch.randn(2, rows, 32, generator=torch.Generator().manual_seed(seed))))
        assert stranger.info()["adapter_tensors"]["bytes"] <= stranger.info()["adapter_tensors"]["max_peer_bytes"]
        output, _ = victim.stream(lora_request(secret, digest))  # the victim's entry is still its own
        with torch.no_grad():
            hidden = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(1))
            expected = local_lm.model.span(hidden, blocks=(0, 2), adapter=BlockAdapter(LORA, secret))
        assert (output - expected).abs().max().item() <= TOLERANCE
        assert victim.info()["adapter_tensors"]["hits"] == 1
    finally:
        victim.close()
        stranger.close()


def test_a_server_that_never_keeps_what_it_claims_is_not_believed_for_long(local_swarm, small_stores, local_lm,
                                                                           tmp_path):
    """Without the score every named call would miss and be resent: one wasted call per step, forever."""
    from swarm.client import DistributedDiffusionLM
    from swarm.wire.remote import MAX_BROKEN_HOLDS

    path, server = small_stores["forgetful"]
    adapter_dir = str(lora_for(local_lm, rank=2, seed=9).save(tmp_path / "lora"))
    peers = local_swarm.initial_peers
    with DistributedDiffusionLM.from_pretrained(path, initial_peers=peers, request_timeout=20) as lm:
        result = lm.generate("forgetful", adapter=adapter_dir, **GENERATION)
        assert result.token_ids == local_lm.generate("forgetful", adapter=adapter_dir, **GENERATION).token_ids
        assert GENERATION["steps"] > 2 * MAX_BROKEN_HOLDS
        assert lm.caller.adapter_misses == MAX_BROKEN_HOLDS, "the liar kept being believed"
        assert lm.caller.holds_distrusted == {server.peer_id}
