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
import time
from functools import partial
from typing import ContextManager

import hivemind
import torch
from hivemind.dht import DHT
from torch import nn

from swarm.finetune.config import CollaborationConfig
from swarm.utils.errors import EXIT_UNREACHABLE, SwarmError

logger = logging.getLogger(__name__)

MATCHMAKING_REQUEST_S = 1.0  # below the matchmaking time, as hivemind recommends (it can deadlock otherwise)
KEY_PREFIX = "swarm-finetune_"  # hivemind derives its DHT keys from the run id: keep them apart from the swarm's


class TooFewPeers(SwarmError):
    """Fewer than ``--min-peers`` peers of the run reported within ``--peer-wait``: the collaboration could not be
    joined (exit 3, as an unreachable swarm), a matter of the others' run id and peers, not a bug."""

    exit_code = EXIT_UNREACHABLE


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
    peer would otherwise take its first steps alone). Returns the peers counted; after
    ``peer_wait`` seconds, :class:`TooFewPeers`."""
    deadline = time.monotonic() + config.peer_wait
    while (peers := peers_in_run(optimizer)) < config.min_peers:
        if time.monotonic() > deadline:
            raise TooFewPeers(f"run {config.run_id}: {peers} of --min-peers {config.min_peers} peers joined within "
                               f"{config.peer_wait:.0f} s; check that the others use the same --run-id and "
                               "--initial-peers")
        time.sleep(poll)
    return peers


def idle(optimizer: hivemind.Optimizer) -> ContextManager[None]:
    """While this peer computes no batch (between two runs of a trainer, e.g. the self-improving loop's rounds): its
    progress tracker stops reading the run's progress and its throughput estimate stops counting the time.

    A peer that stopped keeps the throughput it had: from the records of peers that stopped, hivemind's tracker
    estimates the next global step as overdue and reads the run's progress from the DHT every ``min_refresh_period``
    (0.2 s), five DHT reads a second per idle peer for as long as it idles (each one traffic for the peers it asks).
    Paused, it reads nothing; it reads again at once when the pause ends. Its own record is still stored, so the
    others still count it. Leave the pause before the next ``step`` (which pauses the tracker itself) or shutdown."""
    return optimizer.tracker.pause_updates()


def peer_seed(seed: int, peer_id: str) -> int:
    """A batch seed of its own for each peer: peers with one ``--seed`` must not all draw the same batches."""
    digest = hashlib.sha256(f"{seed}:{peer_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def peers_in_run(optimizer: hivemind.Optimizer) -> int:
    """Peers the collaboration's progress records count now (this one included)."""
    return max(1, int(optimizer.tracker.global_progress.num_peers))  # 0 until the first progress read
