"""Serving a model's bytes to peers that fetch it: the server side of :class:`swarm.weights.wire.WeightService`.

A server that holds a model serves byte ranges of it: a server of a checkpoint directory holds every tensor
(its manifest is built once, hashing every byte, and kept under ``$HF_HOME/swarm/weights/built`` while the
files do not change); a server whose model was fetched from peers holds the tensors it fetched. It announces
what it holds (:func:`swarm.weights.records.declare_host`) with its other records.

Every read is bounded: in length (:data:`~swarm.weights.wire.MAX_READ_BYTES`), in count (:class:`ServeLimits`:
reads at once, and the share one peer may hold), in time (a deadline growing with the length), and all reads
together in bandwidth (``--serve-weights-mbps``). Only bytes of held tensors and files are ever read: a request
names a tensor by its place in the manifest, never a path.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import AsyncIterator, Callable, Optional

from hivemind.dht import DHT
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarm.dht.validation import KeyPolicy
from swarm.weights.cache import ModelCache, cache_root
from swarm.weights.manifest import SHA256, SMALL_FILES, Manifest, ManifestError, build_manifest, weight_files
from swarm.weights.records import HostRecord, declare_host, hosts_policy
from swarm.weights.wire import FILE, MANIFEST, TENSOR, ReadRequest, WeightService, data_messages
from swarm.wire.encoding import STREAM_CHUNK_BYTES, error_response
from swarm.wire.messages import ErrorCode, RemoteError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeLimits:
    """How much of a server serving weights may take (``--serve-weights-mbps`` sets ``mbps``)."""

    max_reads: int = 16  # reads being streamed at once, over all peers
    peer_share: float = 0.25  # the share of them one peer (libp2p id) may hold
    mbps: float = 0.0  # megabits per second for all reads together; 0: no cap
    min_rate: float = 1 * 2**20  # bytes/s a reader must at least take: a read's deadline is 10 s + length / this

    @property
    def per_peer(self) -> int:
        return max(1, int(self.max_reads * self.peer_share))


class Bandwidth:
    """A token bucket shared by every read: ``take(n)`` waits until ``n`` more bytes fit the cap."""

    def __init__(self, mbps: float):
        self.rate = mbps * 1e6 / 8  # bytes per second
        self.available = 0.0
        self.updated = time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        async with self.lock:  # one waiter at a time: reads share the cap in turn
            now = time.monotonic()
            self.available = min(self.rate, self.available + (now - self.updated) * self.rate)  # 1 s of burst
            self.updated = now
            self.available -= nbytes
            if self.available < 0:
                await asyncio.sleep(-self.available / self.rate)


@dataclass
class Holdings:
    """What this peer can serve of one model: the manifest, and where each held file and tensor is."""

    manifest: Manifest
    manifest_bytes: bytes
    files: dict[str, Path]
    tensors: dict[int, tuple[Path, int]]  # place in the manifest -> (file, offset of its first byte)
    cache: Optional[ModelCache] = None  # a copy fetched from peers: tensors fetched later are held too

    @property
    def model_id(self) -> str:
        return self.manifest.model_id

    def refresh(self) -> None:
        if self.cache is not None:
            self.tensors = self.cache.held(self.manifest)

    def host_record(self, peer_id: str, addresses: list[str]) -> HostRecord:
        whole = len(self.tensors) == len(self.manifest.tensors)
        return HostRecord(peer_id, tuple(addresses), len(self.manifest_bytes),
                          None if whole else frozenset(self.tensors))

    @classmethod
    def of_model(cls, path: Path) -> Optional["Holdings"]:
        """What a server of the model at ``path`` can serve: a copy fetched from peers (its manifest is known), or
        a checkpoint directory with every weight file present; None for anything else (a model named by repo id
        holds only the shards it fetched)."""
        path = path.resolve()
        if _fetched_copy(path):
            cache = ModelCache(path.parent.name)
            manifest = cache.load_manifest()
            if manifest is None:
                return None
            return cls(manifest, cache.manifest_path.read_bytes(), _small_files(path, manifest),
                       cache.held(manifest), cache)
        try:
            names = weight_files(path)
        except (ManifestError, OSError, ValueError):
            return None
        if not all((path / name).is_file() for name in names):
            logger.info("not serving the weights of %s: not every weight file is here", path)
            return None
        manifest = built_manifest(path, names)
        tensors = {i: (path / t.file, t.offset) for i, t in enumerate(manifest.tensors)}
        return cls(manifest, manifest.to_bytes(), _small_files(path, manifest), tensors)


def _small_files(directory: Path, manifest: Manifest) -> dict[str, Path]:
    return {entry.name: directory / entry.name for entry in manifest.files}


def _built_place(directory: Path, weight_names: list[str]) -> tuple[Path, list]:
    """Where a directory's manifest is kept, and the sizes and times of the files it was built from."""
    names = sorted({*weight_names, *(name for name in SMALL_FILES if (directory / name).is_file())})
    signature = [[name, (directory / name).stat().st_size, (directory / name).stat().st_mtime_ns] for name in names]
    return cache_root() / "built" / f"{hashlib.sha256(str(directory).encode()).hexdigest()}.json", signature


def kept_manifest(directory: Path, weight_names: list[str]) -> Optional[Manifest]:
    """The manifest built before for ``directory``, if its files have not changed since (no hashing)."""
    kept, signature = _built_place(directory, weight_names)
    try:
        saved = json.loads(kept.read_text())
        if saved["signature"] == signature:
            return Manifest.from_bytes(saved["manifest"].encode())
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def built_manifest(directory: Path, weight_names: list[str]) -> Manifest:
    """The manifest of a checkpoint directory, built once and kept while its files keep their sizes and times."""
    manifest = kept_manifest(directory, weight_names)
    if manifest is not None:
        return manifest
    kept, signature = _built_place(directory, weight_names)
    started = time.monotonic()
    manifest = build_manifest(directory)
    logger.info("built the manifest of %s in %.1f s: model id %s", directory, time.monotonic() - started,
                manifest.model_id)
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        temporary = kept.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"signature": signature, "manifest": manifest.to_bytes().decode()}))
        os.replace(temporary, kept)
    except OSError as error:
        logger.warning("cannot keep the manifest of %s in %s: %s", directory, kept, error)
    return manifest


def known_model_id(path: Path) -> Optional[str]:
    """The model id of the model at ``path`` if it is known without hashing (a fetched copy, or a directory whose
    manifest was built before); None otherwise."""
    path = path.resolve()
    if _fetched_copy(path):
        return path.parent.name
    try:
        manifest = kept_manifest(path, weight_files(path))
    except (ManifestError, OSError, ValueError):
        return None
    return manifest.model_id if manifest is not None else None


def hosts_policies(path: Path) -> list[KeyPolicy]:
    """The hosts key of the model at ``path``, for this peer's DHT storage to bound (when its id is known now)."""
    model_id = known_model_id(path)
    return [hosts_policy(model_id)] if model_id is not None else []


def _fetched_copy(path: Path) -> bool:
    return path.parent.parent == cache_root().resolve() and SHA256.fullmatch(path.parent.name) is not None


class WeightServer(WeightService):
    """Serves the byte ranges of one model's held files and tensors (see the module docstring)."""

    def __init__(self, limits: ServeLimits = ServeLimits()):
        self.limits = limits
        self.holdings: Optional[Holdings] = None  # set once known (building a manifest takes a while)
        self.bandwidth = Bandwidth(limits.mbps)
        self.reading: Counter[str] = Counter()  # reads streaming now, by peer
        self.bytes_served = 0
        self.reads_refused = 0

    async def rpc_read(self, request: runtime_pb2.ExpertRequest,
                       context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        peer = str(context.remote_id)
        try:
            read = ReadRequest.parse(request.metadata)
            source = self._locate(read)
            self._admit(peer)
        except RemoteError as error:
            self.reads_refused += 1
            yield error_response(error)
            return
        self.reading[peer] += 1
        try:
            deadline = time.monotonic() + 10.0 + read.length / self.limits.min_rate
            loop = asyncio.get_running_loop()
            for start in range(read.offset, read.offset + read.length, STREAM_CHUNK_BYTES):
                if time.monotonic() > deadline:  # a reader that takes too slowly holds a read place no longer
                    logger.info("weights read by %s past its deadline: stopped", peer)
                    return
                length = min(STREAM_CHUNK_BYTES, read.offset + read.length - start)
                await self.bandwidth.take(length)
                chunk = await loop.run_in_executor(None, source, start, length)
                self.bytes_served += len(chunk)
                yield data_messages([chunk])[0]
        finally:
            self.reading[peer] -= 1
            if not self.reading[peer]:
                del self.reading[peer]

    def _admit(self, peer: str) -> None:
        if sum(self.reading.values()) >= self.limits.max_reads:
            raise RemoteError(ErrorCode.BUSY, f"{self.limits.max_reads} weight reads are streaming: try another peer")
        if self.reading[peer] >= self.limits.per_peer:
            raise RemoteError(ErrorCode.BUSY, f"a peer may stream {self.limits.per_peer} weight reads at once here")

    def _locate(self, read: ReadRequest) -> Callable[[int, int], bytes]:
        """A reader of (offset, length) of what a valid request names; :class:`RemoteError` otherwise."""
        holdings = self.holdings
        if holdings is None or read.model != holdings.model_id:
            raise RemoteError(ErrorCode.NO_WEIGHTS, f"this peer does not serve model {read.model}")
        if read.kind == MANIFEST:
            data = holdings.manifest_bytes
            size, source = len(data), lambda offset, length: data[offset:offset + length]
        elif read.kind == FILE and read.name in holdings.files:
            size, source = holdings.manifest.file(read.name).size, partial(_pread, holdings.files[read.name], 0)
        elif read.kind == TENSOR and read.name in holdings.tensors:
            size, source = holdings.manifest.tensors[read.name].size, partial(_pread, *holdings.tensors[read.name])
        else:
            raise RemoteError(ErrorCode.NO_WEIGHTS, f"this peer does not hold {read.kind} {read.name!r}")
        if read.offset + read.length > size:
            raise RemoteError(ErrorCode.BAD_REQUEST, f"bytes {read.offset}:{read.offset + read.length} are beyond "
                              f"the {size} of {read.kind} {read.name!r}")
        return source

    def declare(self, dht: DHT, peer_id: str, subkey: bytes, expiration: float, addresses: list[str]):
        """Store this peer's hosts record (a future), or None while nothing is held yet."""
        holdings = self.holdings
        if holdings is None:
            return None
        holdings.refresh()
        return declare_host(dht, holdings.model_id, holdings.host_record(peer_id, addresses), subkey, expiration,
                            wait=False)

    def start(self, path: Path, on_ready: Callable[[], object] = lambda: None) -> None:
        """Find what this peer can serve of the model at ``path`` (building a directory's manifest hashes every
        byte) in a daemon thread, so that a server stopped meanwhile exits at once; ``on_ready`` then runs on the
        calling event loop (to announce the weights without waiting for the next announcement)."""
        loop = asyncio.get_running_loop()

        def find() -> None:
            try:
                holdings = Holdings.of_model(path)
            except Exception as error:  # a broken checkpoint must not take the server down: it serves no weights
                logger.warning("not serving the weights of %s: %s", path, error)
                return
            if holdings is None:
                return
            self.holdings = holdings
            logger.info("serving the weights of %s as model %s (%d of %d tensors)", path, holdings.model_id,
                        len(holdings.tensors), len(holdings.manifest.tensors))
            try:
                loop.call_soon_threadsafe(on_ready)
            except RuntimeError:  # the server has stopped meanwhile
                pass

        threading.Thread(target=find, name="weights-manifest", daemon=True).start()


def _pread(path: Path, base: int, offset: int, length: int) -> bytes:
    """``length`` bytes at ``base + offset`` of ``path`` (a held file: never a name from the network)."""
    with open(path, "rb") as f:
        return os.pread(f.fileno(), length, base + offset)
