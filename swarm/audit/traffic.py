"""Audit traffic a server cannot tell from a client's: whole generations, a sample of their calls recomputed (issue 48).

A single fresh first call is easy to single out: a server that answers it honestly and lies on a session's later
calls, on cache fills and reuses, on head queries or on adapter calls keeps a clean audit. So each round the auditor
also runs whole generations through every server, with a swarm client of its own (:class:`DistributedDiffusionLM`,
on the round's throwaway identity), exactly as a user would: a random prompt, the sampler's settings drawn per
generation (block length, temperature, seed), the server's head when it offers one (the client's ``head="auto"``),
the activation cache in turn none, prefix and dual, and a per-block adapter of a kind the server applies (drawn) in
every other generation. The turns start at a random place and run on across rounds, so any two generations in a row
hold cache calls and adapter calls. The client's spot checker recomputes a random share (``--sample``) of *every*
call of the generation on the auditor's own copy of the blocks (:class:`~swarm.client.reference.LocalReference`,
``reference_only``: no other server's word counts), so a lie on any kind of call is found with probability ``sample``
per lie.

The server is pinned on the route: the client may use it and the servers that hold none of its blocks, so every call
for its blocks goes to it. When those cannot cover the model, the generation is not run (an ``error``, no verdict).

A server lying on a share ``p`` of its calls is caught in one generation of ``c`` calls through it with probability
``1 - (1 - sample x p) ** c``; :func:`generations_to_catch` turns that into the generations needed for a confidence
(``python benchmarks/audit_traffic.py`` measures it; docs/AUDIT.md).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from hivemind.dht import DHT

from swarm.adapters.adapter import base_of, new_adapter
from swarm.adapters.kinds import PER_BLOCK_KINDS
from swarm.client.config import ClientConfig
from swarm.client.model import DistributedDiffusionLM
from swarm.client.reference import LocalReference
from swarm.client.spot_check import NO_CHECKER
from swarm.dht.schema import ServerRecord, ServerState
from swarm.models.loading import ModelFiles
from swarm.reports.records import ERROR, FAIL, MAX_REASON_CHARS, PASS
from swarm.utils.errors import SwarmError

logger = logging.getLogger(__name__)

GEN_LENGTH = 32  # tokens of an audit generation: with steps = GEN_LENGTH, one call per step through each server
BLOCK_LENGTHS = (8, 16, 32)
CACHES = ("none", "prefix", "dual")
TEMPERATURES = (0.0, 0.7)
PROMPT_TOKENS = (4, 32)
ADAPTER_SIZE = 4  # a drawn adapter's prompt vectors or rank


def generations_to_catch(sample: float, lie_rate: float, calls: int, confidence: float = 0.99) -> int:
    """Generations of ``calls`` calls each through a server lying on a share ``lie_rate`` of its calls, at a check
    share ``sample``, after which it has been caught with probability at least ``confidence``."""
    miss_one = (1.0 - sample * lie_rate) ** calls
    if miss_one <= 0.0:
        return 1
    if miss_one >= 1.0:
        raise ValueError("a server that never lies, or a sample of 0, is never caught")
    return max(1, math.ceil(math.log(1.0 - confidence) / math.log(miss_one)))


@dataclass
class TrafficCheck:
    """What the generations through one server found."""

    verdict: str
    reason: str = ""
    generations: int = 0
    calls_checked: int = 0
    kinds: tuple[str, ...] = ()  # the kinds of call checked (``swarm.client.spot_check.call_kind``)


class TrafficAuditor:
    """Runs whole generations through each server as a client and recomputes a sample of their calls (module doc)."""

    def __init__(self, files: ModelFiles, prefix: str, client_config: ClientConfig, reference: LocalReference,
                 rng: random.Random, gen_length: int = GEN_LENGTH):
        self.files, self.prefix, self.rng = files, prefix, rng
        # tokens of each generation, one call per step: GEN_LENGTH, the length the stated odds count (a test of which
        # kinds of call are checked may run shorter ones: every kind of call is in a generation of any length)
        self.gen_length = gen_length
        self.client_config = client_config  # its spot_check_fraction is the sample
        self.reference = reference
        self.turn = rng.randrange(len(CACHES) * 2)  # which cache mode and whether an adapter: runs on over rounds

    def client(self, dht: DHT) -> DistributedDiffusionLM:
        """A fresh client on ``dht`` (the round's identity) whose spot checks recompute on the auditor's blocks."""
        lm = DistributedDiffusionLM(self.files, self.client_config, dht=dht)
        lm.sequence.spot_checker.reference = self.reference
        lm.sequence.spot_checker.reference_only = True
        return lm

    @staticmethod
    def pinned(target: ServerRecord, servers: list[ServerRecord]) -> frozenset[str]:
        """The target and the servers holding none of its blocks: a route over them sends every call for the target's
        blocks to the target."""
        return frozenset({target.peer_id} | {s.peer_id for s in servers
                                             if s.end <= target.start or s.start >= target.end})

    def check(self, lm: DistributedDiffusionLM, target: ServerRecord, servers: list[ServerRecord],
              generations: int) -> TrafficCheck:
        """``generations`` generations through ``target`` (stops at the first wrong answer it gives)."""
        lm.only_peers = self.pinned(target, [s for s in servers if s.state == ServerState.ONLINE])
        found = TrafficCheck(PASS)
        kinds: set[str] = set()
        try:
            for _ in range(generations):
                seen = len(lm.sequence.spot_checker.outcomes)
                error = self._generate(lm, target)
                found.generations += 1
                mine = [o for o in lm.sequence.spot_checker.outcomes[seen:]
                        if o.primary == target.peer_id and o.verdict != NO_CHECKER]
                found.calls_checked += len(mine)
                kinds.update(o.kind for o in mine)
                wrong = next((o for o in mine if o.verdict == "primary_faulty"), None)
                if wrong is not None:
                    found.verdict = FAIL
                    found.reason = (f"wrong answer to a {wrong.kind} call at step {wrong.step} of a generation, blocks "
                                    f"{wrong.blocks[0]}:{wrong.blocks[1]} ({wrong.note})")[:MAX_REASON_CHARS]
                    break
                if error is not None:
                    found.verdict, found.reason = ERROR, f"generation: {error}"[:MAX_REASON_CHARS]
                    break
        finally:
            lm.only_peers = None
        found.kinds = tuple(sorted(kinds))
        return found

    def _generate(self, lm: DistributedDiffusionLM, target: ServerRecord) -> Optional[str]:
        """One generation with settings drawn like a user's; the error that stopped it, if any."""
        rng = self.rng
        config = lm.config
        prompt = [rng.randrange(config.vocab_size) for _ in range(rng.randint(*PROMPT_TOKENS))]
        prompt = [token if token != config.mask_token_id else 0 for token in prompt]
        self.turn += 1
        blocks = [length for length in BLOCK_LENGTHS if self.gen_length % length == 0] or [self.gen_length]
        options = dict(gen_length=self.gen_length, steps=self.gen_length, block_length=rng.choice(blocks),
                       cache=CACHES[self.turn % len(CACHES)], temperature=rng.choice(TEMPERATURES),
                       seed=rng.randrange(2**31), stop_at_eos=False)
        kinds = [kind for kind in target.adapter_kinds if kind in PER_BLOCK_KINDS]
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="audit-adapter-") as directory:
            if kinds and self.turn % 2:
                options["adapter"] = str(self._adapter(lm, rng.choice(kinds), Path(directory)))
            try:
                lm.generate(prompt, **options)
            except (SwarmError, ValueError, RuntimeError) as error:  # a failed call, no route left after a lie
                logger.info("audit generation through %s stopped: %s", target.peer_id, str(error)[:200])
                return str(error)
            finally:
                if "adapter" in options:
                    lm.forget_adapter(options["adapter"])
        logger.debug("audit generation through %s (%s) in %.2f s", target.peer_id,
                     ", ".join(f"{k}={v}" for k, v in options.items() if k != "adapter"), time.perf_counter() - started)
        return None

    def _adapter(self, lm: DistributedDiffusionLM, kind: str, directory: Path) -> Path:
        """A random per-block adapter of ``kind`` for this model, saved in ``directory``."""
        generator = torch.Generator().manual_seed(self.rng.randrange(2**63))
        adapter = new_adapter(kind, ADAPTER_SIZE, lm.config, base_of(lm.config, lm.tokenizer), lm.embedding,
                              generator)
        with torch.no_grad():  # a trained adapter's slices are not zero: make every block's count
            adapter.prompts.add_(0.02 * torch.randn(adapter.prompts.shape, generator=generator))
        return adapter.save(directory / kind)


def client_config(base: ClientConfig, sample: float) -> ClientConfig:
    """The audit client's settings: ``sample`` of every call recomputed, no auditor trusted (it checks every server,
    including those other auditors failed), the head wherever a server offers it."""
    return dataclasses.replace(base, spot_check_fraction=sample, trusted_auditors=("none",), head="auto",
                               spot_check_seed=None)
