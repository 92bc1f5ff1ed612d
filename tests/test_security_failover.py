"""A hostile swarm, item 7: a server killed mid-generation never changes the tokens, in any mode.

The activation cache and stale pipelining are approximations of the exact run, but deterministic ones: the
trajectory depends on the seed and on which states the cache fills were computed on. A failover moves a hop
to a replica without the session's cache, so the client must rebuild the lost version from the tokens it was
first filled with (``DenoiserCalls._recover``), never refill from the current state.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator, Optional

import pytest
import torch

from swarm.client import DistributedDiffusionLM
from swarm.diffusion.config import GenerationConfig
from swarm.diffusion.pipeline import CacheDirective, DenoiserCalls
from swarm.diffusion.sampler import DenoiseContext
from swarm.frontend.local import DiffusionLM
from swarm.models.kv_cache import CacheMiss, SpanKV
from swarm.utils.local_swarm import LocalSwarm, ManagedProcess

SETTINGS = dict(gen_length=16, steps=16, block_length=8, seed=7, temperature=0.7)
PROMPT = "failover"
CACHED = [
    {"cache": "prefix"},
    {"cache": "dual"},
    {"cache": "dual", "cache_refresh": 3},
    {"cache": "dual", "staleness": 2},
    {"cache": "prefix", "staleness": 3, "stale_check": "exact"},
    {"cache": "dual", "staleness": 1, "cfg_scale": 1.0},  # two rows per call: the unconditional copy
    {"cache": "dual", "cache_refresh_drift": 0.02, "staleness": 2},  # 4 of its 8 fills adaptive
]


def name(mode: dict) -> str:
    return "+".join(f"{k}={v}" for k, v in mode.items()) or "exact"


# ----- without network: a server-like cache that loses everything at a chosen call ------------------------
class ReplicaForward:
    """The whole model behind a cache kept like a server's: numbered versions, those older than a fill's
    ``keep_from`` dropped, a version readable once its fill has run. Before each call numbered in ``lose_at``
    every version is lost, as when a failover moves the hop to a replica."""

    def __init__(self, model: torch.nn.Module, lose_at: tuple[int, ...] = ()):
        self.model, self.lose_at = model, set(lose_at)
        self.versions: dict[int, SpanKV] = {}
        self.calls = self.misses = self.uncached = 0
        self.lock = threading.Lock()  # worker threads: count calls and touch versions one at a time

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, directive: Optional[CacheDirective], context: DenoiseContext):
        with self.lock:
            self.calls += 1
            if self.calls in self.lose_at:
                self.versions.clear()
        if directive is None:
            self.uncached += 1
            return self.model(tokens).float()
        if directive.fill:
            kv = SpanKV(tokens.shape[0], tokens.shape[1])
            output = self.model(tokens, kv=kv).float()
            with self.lock:
                for old in [v for v in self.versions if v < directive.keep_from]:
                    del self.versions[old]
                self.versions[directive.version] = kv
            return output
        kv = self.versions.get(directive.version)
        if kv is None:
            with self.lock:
                self.misses += 1
            raise CacheMiss(f"no cache version {directive.version} on this replica")
        start, end = directive.rows
        return self.model(tokens[:, start:end], kv=kv, rows=(start, end)).float()


class ReplicaLM(DiffusionLM):
    """The local model over :class:`ReplicaForward`; ``threaded`` runs calls on worker threads like the swarm
    client (so a reuse may even reach the cache before its fill has run, and miss)."""

    def __init__(self, local: DiffusionLM, lose_at: tuple[int, ...] = (), threaded: bool = False):
        super().__init__(local.model, local.tokenizer, local.path)
        self.lose_at, self.threaded = lose_at, threaded
        self.forward: Optional[ReplicaForward] = None

    @contextlib.contextmanager
    def denoising_session(self, generation: GenerationConfig, adapter=None) -> Iterator[ReplicaForward]:
        if adapter is not None:
            raise ValueError("this test model takes no adapter")
        self.forward = ReplicaForward(self.model, self.lose_at)
        yield self.forward

    def denoiser_workers(self, generation: GenerationConfig) -> int:
        return 2 * generation.staleness + 1 if self.threaded else 0


def loss_points(calls: int, most: int = 16) -> range:
    """Calls before which the cache is lost: every one from the second, or an even spread of about ``most``."""
    return range(2, calls + 1, -(-(calls - 1) // most))


@pytest.mark.parametrize("mode", CACHED, ids=name)
def test_a_lost_cache_is_rebuilt_to_the_same_tokens(local_lm, mode):
    """Losing every cache version before any one call gives the tokens of the run that lost nothing."""
    expected = local_lm.generate(PROMPT, **SETTINGS, **mode).token_ids
    intact = ReplicaLM(local_lm)
    assert intact.generate(PROMPT, **SETTINGS, **mode).token_ids == expected
    assert intact.forward.misses == 0  # keep_from never dropped a version still read
    points = loss_points(intact.forward.calls)
    recovered = 0
    for lose_at in points:
        lossy = ReplicaLM(local_lm, (lose_at,))
        result = lossy.generate(PROMPT, **SETTINGS, **mode)
        assert result.token_ids == expected, f"cache lost before call {lose_at}"
        assert lossy.forward.uncached == 0  # rebuilt, not given up
        recovered += result.info["cache"]["misses"]
    assert recovered >= len(points) // 2  # most loss points are followed by a reuse of the lost version


@pytest.mark.parametrize("mode", [m for m in CACHED if m.get("staleness")], ids=name)
def test_calls_in_flight_on_threads_rebuild_to_the_same_tokens(local_lm, mode):
    """As the swarm client runs them: several calls in flight miss at once; each gets the same answer."""
    expected = local_lm.generate(PROMPT, **SETTINGS, **mode).token_ids
    for lose_at in (3, 6, 11):
        lossy = ReplicaLM(local_lm, (lose_at,), threaded=True)
        assert lossy.generate(PROMPT, **SETTINGS, **mode).token_ids == expected, f"lost before call {lose_at}"
        assert lossy.forward.uncached == 0


def test_a_second_loss_right_after_the_rebuild_is_rebuilt_again(local_lm):
    """Call 4 (a reuse) misses, call 5 rebuilds, the cache is lost again before call 6 (the repeated reuse)."""
    expected = local_lm.generate(PROMPT, **SETTINGS, cache="dual").token_ids
    lossy = ReplicaLM(local_lm, (4, 6))
    result = lossy.generate(PROMPT, **SETTINGS, cache="dual")
    assert result.token_ids == expected
    assert (lossy.forward.misses, result.info["cache"]["misses"], lossy.forward.uncached) == (2, 1, 0)


def test_a_server_that_cannot_keep_the_cache_makes_the_rest_uncached(local_lm, caplog):
    """Every version lost before every call: the rebuilds are bounded, then each answer is the model's own."""
    lossy = ReplicaLM(local_lm, tuple(range(1, 100)))
    result = lossy.generate(PROMPT, **SETTINGS, cache="dual")
    assert result.info["cache"]["misses"] == 1 and lossy.forward.uncached >= SETTINGS["steps"] - 1
    assert "cannot be rebuilt" in caplog.text
    generation = GenerationConfig(**SETTINGS, cache="dual")
    tokens = torch.tensor([local_lm.encode_prompt(PROMPT) + [local_lm.config.mask_token_id] * 16])
    start = tokens.shape[1] - 16
    context = DenoiseContext((0,), start, start + 8, start)
    calls = DenoiserCalls(ReplicaForward(local_lm.model, tuple(range(2, 100))), generation)
    exact = local_lm.logits(tokens)
    torch.testing.assert_close(calls(tokens, context), exact)  # the fill
    torch.testing.assert_close(calls(tokens, context), exact)  # a reuse that cannot be served, then uncached
    assert calls.policy.mode == "none" and calls.rebuilds == 2


# ----- through the swarm: SIGKILL the preferred server mid-run -------------------------------------------
SWARM_CASES = [
    {},
    {"cache": "prefix"},
    {"cache": "dual"},
    {"staleness": 2},
    {"cache": "dual", "staleness": 2},
    {"cache": "dual", "cache_refresh": 3},
    {"cache": "dual", "staleness": 2, "push": True},
]
KILL_AFTER_STEP = 3  # mid-block, right after the refresh fill of cache_refresh=3: reuses of a filled version follow


class Victims:
    """Servers of the whole model that the route prefers (huge announced throughput), one per case: the next
    one boots while the current case still runs, none after the last case's (``cases``: a server booted for no case
    costs a start, ~1 CPU s). The session swarm's servers are the replicas."""

    def __init__(self, swarm: LocalSwarm, path: str, cases: int):
        self.swarm, self.path, self.cases = swarm, path, cases
        self.booting: Optional[ManagedProcess] = self._start()

    def _start(self) -> ManagedProcess:
        return self.swarm.start_server(self.path, "0:4", "--throughput", "1e9", "--compute-threads", "1",
                                       wait=False)

    def take(self) -> ManagedProcess:
        victim, self.booting = self.booting or self._start(), None
        self.cases -= 1
        self.swarm.wait_ready(victim)
        return victim

    def kill(self, victim: ManagedProcess) -> None:
        """SIGKILL (a crash: no OFFLINE announcement) and start the next case's server, if a case is left."""
        self.swarm.terminate(victim, signal.SIGKILL)
        self.booting = self._start() if self.cases > 0 else None

    def release(self, victim: ManagedProcess) -> None:
        if victim.alive:  # the case failed before its kill: leave no preferred server behind
            self.swarm.terminate(victim, signal.SIGKILL)

    def stop(self) -> None:
        if self.booting is not None:
            self.swarm.terminate(self.booting)


@pytest.fixture(scope="module")
def victims(local_swarm, tiny_model_path):
    pool = Victims(local_swarm, str(tiny_model_path), len(SWARM_CASES))
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def failover_lm(local_swarm, tiny_model_path, remote_lm):
    """One client for every case: it re-reads the servers before each generation (so it finds the new
    victim) and keeps avoiding the killed ones. Its peer id is not the point: it reads and calls through the
    session client's DHT peer (``remote_lm``, up already where an earlier file of the worker used it), not a DHT
    process and libp2p daemon of its own."""
    lm = DistributedDiffusionLM.from_pretrained(tiny_model_path, initial_peers=local_swarm.initial_peers,
                                                dht=remote_lm.dht, request_timeout=10, route_refresh=0.0)
    yield lm
    lm.shutdown()


@pytest.mark.parametrize("case", SWARM_CASES, ids=name)
def test_sigkill_mid_generation_keeps_the_local_tokens(victims, failover_lm, local_lm, case):
    settings = {key: value for key, value in case.items() if key != "push"}
    victim = victims.take()
    failover_lm.client_config.push = case.get("push", False)
    checks = failover_lm.client_config.spot_check_fraction
    if case.get("push"):  # passes are pushed only while spot checks are off
        failover_lm.client_config.spot_check_fraction = 0.0
    try:
        assert [hop.peer_id for hop in failover_lm.planner.build_route()] == [victim.peer_id]
        result = None
        for chunk in failover_lm.generate_stream(PROMPT, **SETTINGS, **settings):
            if chunk.step == KILL_AFTER_STEP and victim.alive:
                victims.kill(victim)
            result = chunk.result or result
        assert not victim.alive and result is not None
        assert result.token_ids == local_lm.generate(PROMPT, **SETTINGS, **settings).token_ids
        assert any(event["peer_id"] == victim.peer_id for event in result.info["failovers"])
        assert victim.peer_id not in " ".join(result.info["route"])
        if settings.get("cache"):
            assert result.info["cache"]["misses"] >= 1  # the replicas lacked the cache, and it was rebuilt
            infos = [failover_lm.loop.run(failover_lm.caller.info(hop.peer_id, 5))[0]
                     for hop in failover_lm.planner.route]
            assert all(info["cache"]["fills"] > 0 for info in infos)
    finally:
        failover_lm.client_config.push = False
        failover_lm.client_config.spot_check_fraction = checks
        victims.release(victim)
