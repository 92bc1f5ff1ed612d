"""Training one adapter together: every ``python -m swarm.finetune --run-id NAME`` process is a peer of one
``hivemind.Optimizer`` collaboration.

Each peer computes gradients on its own batches and reports its samples on the DHT; once the peers together
reach ``target_batch_size`` samples they average their gradients (all-reduce over libp2p) and all take the
same Adam step, so N peers move one adapter as one process would with the global batch. A peer that joins
late loads the newest adapter and optimiser state from the others; a peer that leaves (or dies) drops out of
the next averaging round after ``matchmaking_time`` and out of the sample count once its progress record
expires, and the others go on. The defaults suit small adapters on a busy machine: short matchmaking, bounded
averaging, progress records that expire in seconds rather than hivemind's minute.
"""
from __future__ import annotations

import hashlib
import logging
import re
import time
from dataclasses import dataclass
from functools import partial

import hivemind
import torch
from hivemind.dht import DHT
from torch import nn

logger = logging.getLogger(__name__)

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # hivemind refuses '.' in its averaging group names
MATCHMAKING_REQUEST_S = 1.0  # below the matchmaking time, as hivemind recommends (it can deadlock otherwise)
KEY_PREFIX = "swarm-finetune_"  # hivemind derives its DHT keys from the run id: keep them apart from the swarm's


@dataclass
class CollaborationConfig:
    """How a peer joins a collaboration (see the module doc); times in seconds."""

    run_id: str
    target_batch_size: int  # samples of all peers together per optimizer step
    matchmaking_time: float = 2.0  # how long an averaging round waits for peers to join it
    averaging_timeout: float = 15.0  # an all-reduce that takes longer fails; the peer then steps on its own
    load_state_timeout: float = 60.0  # a joining peer waits this long for the others' state
    progress_expiration: float = 15.0  # a peer silent this long no longer counts towards the global batch
    min_peers: int = 1  # after its first batch, a peer waits until this many peers (itself included) report
    peer_wait: float = 120.0  # ... for at most this long (then RuntimeError)

    def validate(self, batch_size: int) -> None:
        if not RUN_ID.fullmatch(self.run_id):
            raise ValueError(f"--run-id {self.run_id!r}: use 1-64 letters, digits, '_' or '-', starting with a "
                             "letter or digit")
        if self.target_batch_size < batch_size:
            raise ValueError(f"--target-batch-size {self.target_batch_size} is below --batch-size {batch_size}: "
                             "each optimizer step needs at least one peer's batch")
        if self.min_peers < 1:
            raise ValueError(f"--min-peers must be at least 1, got {self.min_peers}")
        for name in ("matchmaking_time", "averaging_timeout", "load_state_timeout", "progress_expiration",
                     "peer_wait"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CollaborationConfig.{name} must be positive, got {getattr(self, name)!r}")


def collaborative_optimizer(dht: DHT, config: CollaborationConfig, params: list[nn.Parameter], lr: float,
                            batch_size: int) -> hivemind.Optimizer:
    """Adam on ``params``, stepped once per ``target_batch_size`` samples of all peers with averaged gradients.

    The parameters' state is averaged after every step too (in the background), so peers that missed a round
    (a timeout, a late join) are pulled back to the others.
    """
    config.validate(batch_size)
    return hivemind.Optimizer(
        dht=dht, run_id=KEY_PREFIX + config.run_id, target_batch_size=config.target_batch_size,
        batch_size_per_step=batch_size, optimizer=partial(torch.optim.Adam, lr=lr), params=params,
        matchmaking_time=config.matchmaking_time, averaging_timeout=config.averaging_timeout,
        load_state_timeout=config.load_state_timeout, average_state_every=1,
        tracker_opts=dict(metadata_expiration=config.progress_expiration, min_refresh_period=0.2,
                          default_refresh_period=1.0, max_refresh_period=2.0),
        averager_opts=dict(request_timeout=min(MATCHMAKING_REQUEST_S, config.matchmaking_time / 2)),
        shutdown_timeout=3.0, verbose=False,
    )


def wait_for_peers(optimizer: hivemind.Optimizer, config: CollaborationConfig, poll: float = 0.2) -> int:
    """After this peer's first batch: wait until the run's progress records count ``min_peers`` peers, so that
    peers started together also step together (hivemind counts a peer only once it reported samples, and a fast
    peer would otherwise take its first steps alone). Returns the peers counted; RuntimeError after
    ``peer_wait`` seconds."""
    deadline = time.monotonic() + config.peer_wait
    while (peers := peers_in_run(optimizer)) < config.min_peers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"run {config.run_id}: {peers} of --min-peers {config.min_peers} peers joined within "
                               f"{config.peer_wait:.0f} s; check that the others use the same --run-id and "
                               "--initial-peers")
        time.sleep(poll)
    return peers


def peer_seed(seed: int, peer_id: str) -> int:
    """A batch seed of its own for each peer: peers with one ``--seed`` must not all draw the same batches."""
    digest = hashlib.sha256(f"{seed}:{peer_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def peers_in_run(optimizer: hivemind.Optimizer) -> int:
    """Peers the collaboration's progress records count now (this one included)."""
    return max(1, int(optimizer.tracker.global_progress.num_peers))  # 0 until the first progress read
