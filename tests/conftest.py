"""Shared fixtures: tiny checkpoints in the real native format (:mod:`swarm.testing.checkpoints`), built once per test
session."""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

# The tiny checkpoint builder is defined once in the package (benchmarks use it too); tests import it from here.
from swarm.testing.checkpoints import make_checkpoint, tiny_config
from tests.tier_costs import TierCosts

# Tests run beside servers on small machines: one torch thread avoids oversubscribed, spinning thread pools. The
# environment pins it for the front ends' default (half the CPUs) and for every process a test starts too: float
# sums, and so sampled tokens, depend on the thread count, and a test must give the same tokens on a CI machine with
# more cores than this one (a code-expert test wrote a docstring there, code here).
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

# The caller's environment must not change what a test sees: an offline machine's HF_HUB_OFFLINE=1 turned a hub
# error into the offline message, a user's $SWARM_INITIAL_PEERS would send commands to their swarm, other OMP_* knobs
# change float sums. Tests that need one of these set it themselves (monkeypatch, or a subprocess's env).
CALLER_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "SWARM_", "OMP_", "MKL_", "OPENBLAS_NUM_THREADS")
CALLER_KEPT = {"OMP_NUM_THREADS"}  # pinned above


def scrub_caller_environment(environ: dict) -> list[str]:
    """Remove the caller's settings of the project, the hub and the thread pools from ``environ``; returns them."""
    removed = sorted(name for name in environ if name.startswith(CALLER_PREFIXES) and name not in CALLER_KEPT)
    for name in removed:
        del environ[name]
    return removed


scrub_caller_environment(os.environ)

# Work stamps (swarm.dht.stamp) at the default difficulty cost minutes of CPU per shared list: tests and the processes
# they start price them at 8 bits (the admission logic is the same at any difficulty; tests/test_dht_keys.py checks a
# list refusing stamps below its bits), kept in a stamp cache of their own.
os.environ["SWARM_STAMP_BITS"] = "8"
os.environ["SWARM_STAMP_CACHE"] = tempfile.mkdtemp(prefix="swarm-stamps-")


def remove_stamp_cache(path: str = os.environ["SWARM_STAMP_CACHE"], owner: int = os.getpid()) -> None:
    """Remove this pytest process's stamp cache when it exits (1,304 were left in /tmp here), and only in it: a
    process forked from it inherits this hook and must not remove the directory that its parent still uses."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


atexit.register(remove_stamp_cache)


# ----- tiers (docs/TESTING.md) --------------------------------------------------------------------------------
# A test's tier: its own marker if it has one; else the tier of a fixture it uses (directly or not) from
# TIER_FIXTURES; else its file's tier. "unit" and "wide" are checked: such a test that starts a process or opens a
# network socket, in its fixtures or its body, fails and says to mark it. "wide" is in process like "unit", at
# LLaDA-8B's widths (gigabytes of weights, minutes of CPU), so that `-m unit` stays a quick check (docs/TESTING.md).
TIERS = ("unit", "wide", "swarm", "lab", "browser")
IN_PROCESS_TIERS = ("unit", "wide")
TIER_FIXTURES = {"browser": "browser", "lab": "lab", "local_swarm": "swarm"}  # the first one used decides
FILE_TIERS = {  # a "unit" file may hold tests of other tiers: found by their fixtures, or marked
    **dict.fromkeys(["test_adapter_digest", "test_adapter_sharing", "test_api", "test_cli", "test_config_settings",
                     "test_deep_prompt", "test_draft_verify", "test_eval", "test_experts", "test_finetune",
                     "test_first_day", "test_formats", "test_governance", "test_head", "test_health",
                     "test_latency_hiding", "test_layers", "test_lazy_imports", "test_lora", "test_model", "test_nat",
                     "test_real_size", "test_sampler", "test_security_adapters", "test_security_client",
                     "test_security_failover", "test_security_parsers", "test_security_records", "test_security_server",
                     "test_settings_sources",
                     "test_spot_checks", "test_subword", "test_train", "test_union", "test_validation",
                     "test_weights_parsers", "test_web"], "unit"),
    **dict.fromkeys(["test_bottleneck", "test_docker", "test_failover", "test_finetune_together", "test_forkserver",
                     "test_hub", "test_weights", "test_weights_hints", "test_security_api", "test_security_dht",
                     "test_swarm"], "swarm"),
    "test_daemons": "lab",
    "test_audit": "unit",  # the records, in process; the auditor against a live swarm is test_audit_swarm
    "test_audit_swarm": "swarm",
    "test_audit_traffic": "swarm",
    "test_receipts": "unit",  # receipts, evidence and proofs in process; against live liars: test_audit_traffic
    "test_adapter_versions": "unit",  # the parsers in process; versions and adoption on the live swarm (fixtures)
    "test_improve": "swarm",
    "test_advise": "unit",
    "test_stream_records": "unit",  # the record, its parser and refusals in process; one DHT round trip (swarm)
    "test_self_prompt": "unit",
    "test_streams": "unit",
    "test_streams_demo": "unit",  # the streams demonstration's bookkeeping, table and plot (the demo: a command)
    "test_usage": "unit",  # the ledger, the cap and the retry hint, in process; a live server in test_usage_swarm
    "test_usage_swarm": "swarm",
    "test_dht_pipe": "unit",  # the DHT process's command pipe, in process; one real DHT process (marked swarm)
    "test_dht_keys": "unit",  # the key registry, the walk over the code's DHT keys, the storage fuzzed in process
    "test_security_keys": "swarm",  # keys flooded before they are written, on live DHT peers
    "test_scheduler": "unit",  # the fair scheduler, pure
    "test_evidence_handoff": "unit",  # evidence handed to an auditor: header, body, stamps, fair queue, fuzzed
    "test_work_stamps": "unit",  # proof of work for the fair order: minted, checked, credited once; parser fuzzed
    "test_tiers": "unit",  # TESTING.md's tiers and budget against this file's and tests/tier_costs.py's
    "test_invariance_check": "unit",  # check_module on this CPU, and the scale's use of its answer
    "test_batching_queue": "unit",  # merging waiting passes on the compute thread, in process
    "test_batching": "swarm",  # concurrent clients on a live server, batched: each gets its solo run's tokens
    "test_liveness": "swarm",  # issue 56 item 4: the map and the client after a server dies
    "test_readme": "unit",  # the markers in process; the snippets (processes, a swarm) are marked swarm
    "test_newcomer": "unit",  # issue 56: install lines, errors that name the fix, the tokenizer, in process
    "test_client_memory": "unit",  # the challenge a client embeds (issue 54; its 8B-width measurement: test_invariance)
    "test_wan": "swarm",  # a swarm behind delaying TCP proxies: crossings per step counted, every mode at 150 ms
}


def tier_of(item: pytest.Item) -> str:
    for tier in TIERS:
        if item.get_closest_marker(tier):
            return tier
    for fixture, tier in TIER_FIXTURES.items():
        if fixture in item.fixturenames:
            return tier
    module = Path(str(item.fspath)).stem
    if module not in FILE_TIERS:
        raise pytest.UsageError(f"tests/{module}.py has no tier: add it to FILE_TIERS in tests/conftest.py")
    return FILE_TIERS[module]


def pytest_configure(config):
    config.pluginmanager.register(TierCosts(TIERS, worker=hasattr(config, "workerinput")), "tier_costs")
    # A crashed worker ends the run at once, naming its test, unless --max-worker-restart says otherwise: after
    # replacing a crashed worker, pytest-xdist 3.8 with --dist loadfile can wait for good on work already done
    # (pytest-xdist issue 1378), and a worker killed for memory cost CI its whole 90 minutes (2026-12-06). This runs
    # before xdist's own pytest_configure (trylast), which reads the option.
    if getattr(config.option, "maxworkerrestart", "") is None:
        config.option.maxworkerrestart = "0"


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = tier_of(item)
        if not item.get_closest_marker(tier):
            item.add_marker(tier)


def pytest_collection_finish(session):
    """Freeze what imports and collection made (torch, hivemind, every test module: most of the heap) out of the
    cyclic garbage collector's reach: each full collection during the tests, and the five at the session's end
    (pytest's unraisable-exception check), walked all of it again. Measured on six unit files in one process
    (docs/TESTING-HISTORY.md, "The unit tier's CPU"): full collections 2.8 -> 1.8 CPU s, the session's end 1.4 ->
    0.5. The garbage of imports and collection is freed first, not frozen with the rest."""
    from swarm.utils.collector import freeze_loaded

    freeze_loaded()


# ----- scheduling over pytest-xdist workers (.ci/run: -n 3 --dist loadfile) ------------------------------------
# Files that take longest in wall time, longest first (per-file spans of a three-worker run, docs/TESTING.md
# "Forked servers, the longest files first"; re-ranked 2026-12-06 23:30 from benchmarks/xdist_timeline.py, where
# test_wan, then unlisted, started last at 329 s and ended the run at 359 s): they start first, so that no worker
# begins a long file when the others are nearly done. xdist itself queues files by their number of tests, which put
# the few-but-long ones last.
# Unlisted files follow in xdist's order; a listed name that is no file is refused, so the list cannot rot silently.
# The 8B-width file (test_invariance) holds WIDE_LOCK and starts at once.
LONGEST_FILES = ("test_invariance", "test_audit_swarm", "test_improve", "test_audit_traffic", "test_security_dht",
                 "test_readme", "test_security_server", "test_nat", "test_governance", "test_wan", "test_web",
                 "test_security_failover", "test_security_client", "test_finetune_together", "test_weights",
                 "test_draft_verify", "test_daemons", "test_real_size", "test_head", "test_eval", "test_hub",
                 "test_adapter_versions", "test_security_keys", "test_failover", "test_security_parsers",
                 "test_swarm", "test_latency_hiding", "test_finetune", "test_cli", "test_liveness")


@pytest.hookimpl(optionalhook=True)  # without pytest-xdist (`-p no:xdist`) the hook does not exist
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    missing = [name for name in LONGEST_FILES if not (Path(__file__).parent / f"{name}.py").exists()]
    if missing:
        raise pytest.UsageError(f"LONGEST_FILES in tests/conftest.py names no test file: {', '.join(missing)}")
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}

    class LongestFilesFirst(LoadFileScheduling):
        ordered = False

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the queue is complete before the first unit is handed out
                queue = sorted(self.workqueue.items(), key=lambda item: rank.get(Path(item[0]).stem, len(rank)))
                self.workqueue.clear()
                self.workqueue.update(queue)
                self.ordered = True
            super()._assign_work_unit(node)

    return LongestFilesFirst(config, log)


HARMLESS_PROGRAMS = {"uname"}  # platform.processor() asks it (gensim does, once per process)


def _refuse(what: str):
    raise RuntimeError(f"a unit (or wide) test {what}: mark it swarm or lab (or use a fixture of TIER_FIXTURES, or "
                       "change its file's tier in tests/conftest.py)")


@contextlib.contextmanager
def in_process_only():
    """Refuse new processes (but HARMLESS_PROGRAMS) and network sockets while the block runs."""
    import subprocess

    popen, fork = subprocess.Popen.__init__, os.fork

    def guarded_popen(self, args, *rest, **kwargs):
        program = args if isinstance(args, (str, bytes, os.PathLike)) else args[0]
        if os.path.basename(os.fsdecode(program)) not in HARMLESS_PROGRAMS:
            _refuse(f"started a process ({program})")
        popen(self, args, *rest, **kwargs)

    def guarded_fork():
        _refuse("forked")

    originals = {method: getattr(socket.socket, method) for method in ("bind", "connect", "connect_ex")}

    def guard(method):
        def guarded(self, address, *args):
            if self.family in (socket.AF_INET, socket.AF_INET6):
                _refuse(f"used a network socket ({method} {address})")
            return originals[method](self, address, *args)
        return guarded

    subprocess.Popen.__init__, os.fork = guarded_popen, guarded_fork
    for method in originals:
        setattr(socket.socket, method, guard(method))
    try:
        yield
    finally:
        subprocess.Popen.__init__, os.fork = popen, fork
        for method in originals:
            delattr(socket.socket, method)  # back to the inherited _socket.socket methods


def _guarded(item: pytest.Item):
    in_process = any(item.get_closest_marker(tier) for tier in IN_PROCESS_TIERS)
    return in_process_only() if in_process else contextlib.nullcontext()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _guarded(item):  # fixtures too, whatever their scope: a unit test needs none that starts a process
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _guarded(item):
        return (yield)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_config())


@pytest.fixture(scope="session")
def sharded_model_path(tmp_path_factory) -> Path:
    """Same weights as ``tiny_model_path``, sharded so that blocks live in different files."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_sharded"), tiny_config(), max_shard_bytes=40_000)


# ----- a live local swarm, shared by every test that needs one ----------------------------------------
SHARED_SWARM_THROUGHPUT = "10"  # tokens/s the shared swarm's servers announce (see local_swarm)


@pytest.fixture(scope="session")
def local_swarm(tiny_model_path):
    """A bootstrap peer and three servers of the tiny model: 0:2, 2:4 and an overlapping replica 1:4.

    They announce ``SHARED_SWARM_THROUGHPUT`` tokens/s. A route's cost is each hop's measured round trip plus its
    tokens over the announced throughput: at LocalSwarm's default 1000 the compute terms (0.13 s a hop for 128 tokens)
    were within the ping noise of a loaded machine, so a test's ``fast_server`` (1e9) or the 1:4 replica lost routes
    they win on a quiet one. At 10 tokens/s the compute terms are seconds and decide every route.

    They announce every 15 s, the servers' default (LocalSwarm's); records live 37.5 s."""
    from swarm.utils.local_swarm import LocalSwarm

    with LocalSwarm(fork_server=True) as swarm:
        swarm.start_bootstrap()
        servers = [swarm.start_server(str(tiny_model_path), span, "--compute-threads", "1", "--throughput",
                                      SHARED_SWARM_THROUGHPUT, wait=False)
                   for span in ("0:2", "2:4", "1:4")]
        for server in servers:
            swarm.wait_ready(server)
        yield swarm
        for managed in swarm.processes:  # every server leaves at once (1-3 s each); the bootstrap peer stops last
            if managed is not swarm.bootstrap and managed.alive:
                managed.process.send_signal(signal.SIGTERM)


@pytest.fixture(scope="session")
def remote_lm(local_swarm, tiny_model_path):
    from swarm.client import DistributedDiffusionLM

    # Checks off: tests through this client count calls, rows, pushed passes and head loads exactly, and the default
    # spot checks (5% of hops) add checker calls and may load the head; tests/test_audit_traffic.py and
    # tests/test_spot_checks.py check the default's checks
    lm = DistributedDiffusionLM.from_pretrained(tiny_model_path, initial_peers=local_swarm.initial_peers,
                                                request_timeout=20, spot_check_fraction=0)
    yield lm
    lm.shutdown()


@pytest.fixture(scope="session")
def local_lm(tiny_model_path):
    from swarm.frontend.local import DiffusionLM

    return DiffusionLM.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def swarm_peer(local_swarm):
    """A client-mode DHT peer on the shared swarm that one file's clients, auditors, readers and writers share
    (``dht=``): a DHT of each one's own is a DHT process and a libp2p daemon, 1-2 CPU s apiece. Clients sharing it
    share one peer id, so a caller whose identity is the point (a peer id a liar tells apart, bans, fair shares or
    stamps a server keeps per caller, a client that joins or leaves itself) keeps one of its own; so does a client
    whose own DHT's protection of its model's keys is tested (hostile records: ``start_dht(protect=...)`` is set
    per client, and this peer protects no prefix)."""
    from swarm.dht.config import NetworkConfig
    from swarm.dht.node import start_dht, stop_dht

    dht = start_dht(NetworkConfig(initial_peers=local_swarm.initial_peers, client_mode=True))
    yield dht
    stop_dht(dht)


# ----- servers and clients on the shared swarm (or any LocalSwarm) ----------------------------------------------
def swarm_client(swarm, path, **options):
    """A client of the model at ``path`` joined through ``swarm``'s bootstrap peer (``with`` it, or shutdown())."""
    from swarm.client import DistributedDiffusionLM

    return DistributedDiffusionLM.from_pretrained(path, initial_peers=swarm.initial_peers, **options)


def wait_seen(lm, servers, timeout: float = 60.0) -> None:
    """Re-read the servers until ``lm``'s planner knows every one of ``servers`` (ManagedProcess) as usable, then
    rebuild its route. For a test that asserts which server a route picks: on a loaded machine a DHT read can miss
    a peer's reply (a timeout), and the route is then planned without that server."""
    wanted = {server.peer_id for server in servers}

    def all_seen() -> bool:
        lm.planner.refresh()
        return all(peer in lm.planner.servers and lm.planner.health.usable(peer) for peer in wanted)

    assert wait_until(all_seen, timeout=timeout, interval=1.0), f"the client never saw {sorted(wanted)}"
    lm.planner.build_route(0)


SHARED_MEMORY = Path("/dev/shm")  # tmpfs: files here are memory
WIDE_SHM_PREFIX = "swarm-test-8b-width-"
WIDE_CHECKPOINT_BYTES = 3 * 2**30


def memory_backed_folder(tmp_path_factory) -> Path:
    """A folder in memory (``/dev/shm``) for the 2.5 GB checkpoint of 8B widths where there is room for it, else a
    temporary one.

    Writing it to this machine's disk took 9 of the 20 s its build takes when quiet, and most of 60-90 s beside
    other tests; to memory, under 1 s. A folder left by a killed run (its pid gone) is removed first."""
    import shutil
    import tempfile

    import psutil

    for leftover in SHARED_MEMORY.glob(f"{WIDE_SHM_PREFIX}*"):
        pid = leftover.name[len(WIDE_SHM_PREFIX):].split("-")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)
    roomy = SHARED_MEMORY.is_dir() and shutil.disk_usage(SHARED_MEMORY).free > 2 * WIDE_CHECKPOINT_BYTES
    if roomy and psutil.virtual_memory().available > 4 * WIDE_CHECKPOINT_BYTES:
        return Path(tempfile.mkdtemp(prefix=f"{WIDE_SHM_PREFIX}{os.getpid()}-", dir=SHARED_MEMORY))
    return tmp_path_factory.mktemp("llada-8b-width")


# One file at a time at 8B widths on this machine, whatever the worker or the run: two such files at once, each with its
# checkpoint in memory beside its models or servers, took 22 of a 24 GB machine, the kernel killed a worker, and
# pytest-xdist (3.8, --dist loadfile) then hung until CI's 90 minutes ran out (2026-12-06).
WIDE_LOCK = Path(tempfile.gettempdir()) / "swarm-test-8b-width.lock"


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """1 block of LLaDA-8B's widths and its vocabulary, bfloat16, realscale's builder (loads in seconds), built for
    each file that uses it and removed after it: held for a worker's whole run, its 2.5 GB of memory would sit beside
    every later file's. The file holds ``WIDE_LOCK`` from the build to the removal. One block: what these tests hold
    is per product and per block (the widths, where kernels choose their reductions), not the depth; a second block
    cost every 8B-width pass a third more and the build its copy (several blocks per span and route: the default
    model's widths, tests/test_swarm.py)."""
    import fcntl
    import shutil

    from swarm.benchmark.realscale import build_checkpoint

    with open(WIDE_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, also when the worker dies
        folder = memory_backed_folder(tmp_path_factory)
        try:
            yield build_checkpoint(folder, 1)
        finally:
            if folder.parent == SHARED_MEMORY:
                shutil.rmtree(folder, ignore_errors=True)


def read_until_known(lm, find: Callable[[], Optional[str]], what: str, timeout: float = 60.0) -> str:
    """``find()``, re-reading the DHT until it finds something: the test that asks may be the first to use a shared
    client (run alone, or in another order), whose planner has read nothing yet."""
    if find() is None:
        assert wait_until(lambda: lm.planner.refresh() or find() is not None, timeout=timeout, interval=1.0), (
            f"the client never saw {what}")
    return find()


def known_server(lm, match: Callable) -> str:
    """The first server ``lm``'s planner knows whose record ``match`` accepts."""
    return read_until_known(lm, lambda: next((peer for peer, record in lm.planner.servers.items() if match(record)),
                                             None), "such a server")


def holder_of(lm, start: int, end: int) -> str:
    """The fastest usable server of blocks ``start:end`` that ``lm`` knows."""
    return read_until_known(lm, lambda: next(iter(lm.planner.holders(start, end)), None),
                            f"a server of blocks {start}:{end}")


def fast_server(swarm, path, blocks: str = "0:4", *extra: str, wait: bool = True):
    """A server that announces a huge throughput, so that routes prefer it over the fixture's servers."""
    return swarm.start_server(str(path), blocks, "--throughput", "1e9", "--compute-threads", "1", *extra, wait=wait)


SERVER = ("-m", "swarm.server")
# For a server no test watches re-announce (its record is read after its start, or not at all): LocalSwarm's servers
# announce every 15 s (the servers' default; 5 before 2026-12-06), and each announcement is DHT stores through every
# peer's daemon. Six idle servers of the tiny model spent 3.8-4.6 CPU s in 40 s at 5 s and 0.7 at 30 s (2026-12-06,
# load 21). Records then live 75 s (2.5 x).
RARE_ANNOUNCEMENTS = ("--update-period", "30")


def start_all(swarm, path, specs):
    """Servers given as (blocks, extra args[, entry]) started at once, then waited for: one boot's time for all."""
    servers = [swarm.start_server(str(path), blocks, "--compute-threads", "1", *extra, entry=entry, wait=False)
               for blocks, extra, entry in ((*spec, SERVER)[:3] for spec in specs)]
    wait_all(swarm, servers)
    return servers


def wait_all(swarm, servers) -> None:
    """Wait for each server started with ``wait=False`` that has not said READY yet."""
    for server in servers:
        if not server.peer_id:
            swarm.wait_ready(server)


def later_users(request, fixture: str) -> list:
    """The tests of ``request``'s module that run after it and use ``fixture``: a test that stopped a module's shared
    server starts it again only for them (whatever the order: a shuffled run puts any test after it)."""
    later = request.session.items[request.session.items.index(request.node) + 1:]
    return [item for item in later if getattr(item, "module", None) is request.module and fixture in item.fixturenames]


def stop_all(swarm, servers) -> None:
    """SIGKILL each server and its daemons at once. For servers of a model (a DHT prefix) that no later test reads:
    a graceful stop takes 1-3 s apiece to announce OFFLINE, which nobody would read (the shared swarm's model
    and any prefix shared with other tests need ``swarm.terminate``)."""
    for server in servers:
        swarm.terminate(server, signal.SIGKILL)


# ----- raw calls ----------------------------------------------------------------------------------------------
def raw_answer(run_call: Callable[[], list], peer_id: str, collect: Optional[Callable] = None):
    """A raw RPC's decoded answer (``run_call`` makes the call and returns its response parts; ``collect`` decodes
    them, by default ``collect_response``). Like the client's ``RemoteCaller._call``, an answer that came back
    empty is asked for once more: hivemind's loopback streams rarely lose one while other calls are in flight (seen
    in two- and three-worker runs). A server's own refusal is never empty, so it is never sent twice."""
    from swarm.wire.encoding import collect_response

    parts = run_call()
    return (collect or collect_response)(parts or run_call(), peer_id)


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
