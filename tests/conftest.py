"""Shared fixtures: tiny checkpoints in the real native format, built once per test session."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from swarm.models.checkpoint import save_checkpoint
from swarm.models.config import ModelConfig
from swarm.models.modules import DiffusionTransformer
from swarm.models.tokenizer import ByteTokenizer

# Tests run beside servers on small machines: one torch thread avoids oversubscribed, spinning thread pools.
torch.set_num_threads(1)


def tiny_config(**changes) -> ModelConfig:
    tok = ByteTokenizer()
    base = dict(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        mask_token_id=tok.MASK, pad_token_id=tok.PAD, bos_token_id=tok.BOS, eos_token_id=tok.EOS,
        rope_theta=10000.0, max_position_embeddings=512,
    )
    base.update(changes)
    return ModelConfig(**base)


def make_checkpoint(directory: Path, config: ModelConfig, seed: int = 0, max_shard_bytes=None) -> Path:
    """A randomly initialised model with weights large enough that outputs depend on every block."""
    torch.manual_seed(seed)
    model = DiffusionTransformer(config)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.2 if param.dim() > 1 else 1.0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
    save_checkpoint(directory, config, model.native_state_dict(), max_shard_bytes=max_shard_bytes)
    return directory


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_config())


@pytest.fixture(scope="session")
def sharded_model_path(tmp_path_factory) -> Path:
    """Same weights as ``tiny_model_path``, sharded so that blocks live in different files."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_sharded"), tiny_config(), max_shard_bytes=40_000)


# ----- a live local swarm, shared by every test that needs one ----------------------------------------
@pytest.fixture(scope="session")
def local_swarm(tiny_model_path):
    """A bootstrap peer and three servers of the tiny model: 0:2, 2:4 and an overlapping replica 1:4."""
    from swarm.utils.local_swarm import LocalSwarm

    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        servers = [swarm.start_server(str(tiny_model_path), span, "--compute-threads", "1", wait=False)
                   for span in ("0:2", "2:4", "1:4")]
        for server in servers:
            swarm.wait_ready(server)
        yield swarm


@pytest.fixture(scope="session")
def remote_lm(local_swarm, tiny_model_path):
    from swarm.client import DistributedDiffusionLM

    lm = DistributedDiffusionLM.from_pretrained(tiny_model_path, initial_peers=local_swarm.initial_peers,
                                                request_timeout=20)
    yield lm
    lm.shutdown()


@pytest.fixture(scope="session")
def local_lm(tiny_model_path):
    from swarm.local import DiffusionLM

    return DiffusionLM.from_pretrained(tiny_model_path)


# ----- waiting on events instead of sleeping --------------------------------------------------------------
def wait_until(condition: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False): for tests that wait on an
    observable event (a log line, a counter, a record) rather than sleeping for a guessed time."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
