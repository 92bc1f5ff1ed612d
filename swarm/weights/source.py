"""``--model ID`` (or a published name): a model whose bytes come from the peers that serve it.

:class:`SwarmWeights` is a resolver for :func:`swarm.models.loading.resolve_model`: given a model id (64 hex
digits) or a published name (``NAME`` by a publisher the caller trusts, :mod:`swarm.weights.trust`, or
``NAME@PUBLISHER``) it finds the model's manifest and small files on the
swarm, checks them (the manifest against its id, every file against the manifest, the tensors' shapes against
the config) and installs them in the cache; the tensors come later, only those a part reads
(``ModelSource.fetch``): a server of blocks 2:4 fetches blocks 2 and 3, and nothing else.

It joins the swarm with a short-lived client DHT peer of its own (the caller's own peer may not exist yet: a
server resolves its model before it joins), closed once idle; a caller in the same process that has a DHT peer
already (a client given ``dht=``, a test) passes it as ``dht`` instead, and it is used and never closed here (each
DHT peer is a process and a libp2p daemon of its own). It must not be a host of the model: a peer cannot dial
itself. A model already installed opens without any network.
"""
from __future__ import annotations

import errno
import logging
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional, Sequence

from hivemind.dht import DHT

from swarm.dht.node import NetworkConfig, start_dht, stop_dht
from swarm.dht.peers import resolve_initial_peers
from swarm.models.loading import ModelSource
from swarm.utils.event_loop import BackgroundLoop
from swarm.weights.cache import ModelCache, tensor_indices
from swarm.weights.fetch import FetchConfig, Fetcher, FetchReport, PeerBook
from swarm.weights.manifest import MODEL_NAME, Manifest, ManifestError
from swarm.weights.records import (
    WeightsError,
    choose_published,
    parse_reference,
    read_hosts,
    read_published,
    reference_publishers,
)
from swarm.weights.trust import PublisherTrust
from swarm.weights.wire import FILE, ReadRequest

logger = logging.getLogger(__name__)

MODEL_ID = re.compile(r"[0-9a-f]{64}")
REFERENCE = re.compile(rf"{MODEL_NAME.pattern}(@[0-9a-f]{{16}})?")
IDLE_CLOSE_S = 30.0  # seconds the client DHT peer stays up after its last use


@contextmanager
def full_disk_said(cache: ModelCache) -> Iterator[None]:
    """A full disk as one line that says where and what to do (the parts checked so far stay for the next try)."""
    try:
        yield
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        raise WeightsError(f"model {cache.model_id}: no space left on the disk of {cache.directory.parent} while "
                           f"fetching it: free some, or point HF_HOME at a larger disk") from None


@dataclass
class SwarmWeights:
    """Resolves swarm model ids and published names, and fetches their tensors when a part needs them."""

    network: NetworkConfig = field(default_factory=NetworkConfig)
    config: FetchConfig = field(default_factory=FetchConfig)
    trust: PublisherTrust = field(default_factory=PublisherTrust.of)  # whose names resolve: the governance keys
    banned: dict[str, str] = field(default_factory=dict)  # peers that sent wrong bytes, for every later fetch
    reports: list[FetchReport] = field(default_factory=list)
    dht: Optional[DHT] = None  # the caller's DHT peer to work through (theirs to close); None: one of its own

    def __post_init__(self) -> None:
        self._dht: Optional[DHT] = None
        self._lock = threading.RLock()
        self._closer: Optional[threading.Timer] = None

    # ----- the resolver --------------------------------------------------------------------------------
    def resolve(self, name: str) -> Optional[ModelSource]:
        """The source of a swarm model id or published name; None for a name that is neither (or a bare name
        when no swarm is configured to look it up in)."""
        if MODEL_ID.fullmatch(name):
            return self.open(name)
        if not REFERENCE.fullmatch(name) or not self.has_swarm():
            return None
        reference, publisher = parse_reference(name)
        if not self.trust.names or (publisher is None and not self.trust.keys):  # refused before any network
            choose_published([], name, self.trust)
        publishers = reference_publishers(publisher, self.trust)
        record = choose_published(self._with_dht(lambda dht: read_published(dht, reference, publishers)), name,
                                  self.trust)
        logger.info("model %r is %s, published by %s", name, record.model_id, record.publisher_id)
        return self.open(record.model_id, record.manifest_bytes)

    def has_swarm(self) -> bool:
        return bool(resolve_initial_peers(self.network.initial_peers, use_defaults=self.network.use_default_peers))

    def open(self, model_id: str, manifest_bytes: Optional[int] = None) -> ModelSource:
        """The installed copy of ``model_id``, installing its manifest and small files first if needed."""
        cache = ModelCache(model_id)
        with cache.locked(), full_disk_said(cache):
            manifest = cache.load_manifest()
            if manifest is None or not cache.model_dir(manifest).is_dir():
                if not self.has_swarm():
                    raise WeightsError(f"model {model_id} is not in the cache ({cache.directory}) and no swarm is "
                                       f"configured to fetch it from: pass --initial-peers")
                manifest = self._with_dht(lambda dht: self._install(dht, cache, manifest_bytes))
        return ModelSource(cache.model_dir(manifest), lambda files: self.fetch(cache, manifest, files))

    def _install(self, dht: DHT, cache: ModelCache, manifest_bytes: Optional[int]) -> Manifest:
        fetcher = self._fetcher(dht, cache.model_id)
        loop = BackgroundLoop.shared()
        data = loop.run(fetcher.read_manifest(manifest_bytes))  # each host asked the size it claims itself
        try:
            manifest = Manifest.from_bytes(data, cache.model_id)
        except ManifestError as error:
            raise WeightsError(f"model {cache.model_id}: refused its manifest: {error}") from None
        files = {}
        for entry in manifest.files:
            request = ReadRequest(cache.model_id, FILE, entry.name, 0, entry.size)
            files[entry.name] = loop.run(fetcher.read_checked(request, entry.sha256, None, entry.name))
        try:
            cache.install(data, manifest, files)
        except ManifestError as error:
            raise WeightsError(f"model {cache.model_id}: refused its manifest: {error}") from None
        logger.info("model %s (%s): manifest and %d files installed in %s", cache.model_id, manifest.name,
                    len(files), cache.directory)
        return manifest

    # ----- tensors, when a part needs them ---------------------------------------------------------------------
    def fetch(self, cache: ModelCache, manifest: Manifest, file_names: Sequence[str]) -> None:
        """Bring the tensor files a part reads (the cache's own names) that are not there yet."""
        indices = tensor_indices(list(file_names), len(manifest.tensors))
        if all(cache.tensor_path(manifest, i).exists() for i in indices):
            return
        with cache.locked(), full_disk_said(cache):  # another process may be fetching some: not asked again
            missing = [i for i in indices if not cache.tensor_path(manifest, i).exists()]
            if missing:
                self._fetch(cache, manifest, missing)

    def _fetch(self, cache: ModelCache, manifest: Manifest, missing: list[int]) -> None:
        nbytes = sum(manifest.tensors[i].size for i in missing)
        logger.info("fetching %d tensors (%.1f MB) of model %s from peers", len(missing), nbytes / 1e6,
                    cache.model_id)

        def run(dht: DHT) -> FetchReport:
            fetcher = self._fetcher(dht, cache.model_id)
            return BackgroundLoop.shared().run(fetcher.fetch_tensors(manifest, cache, missing))

        report = self._with_dht(run)
        self.reports.append(report)
        peers = ", ".join(f"{peer[-8:]} {n / 1e6:.1f} MB" for peer, n in report.bytes_by_peer.most_common())
        logger.info("fetched %.1f MB of model %s in %.1f s (%.1f MB/s) from %d peers (%s)%s", report.nbytes / 1e6,
                    cache.model_id, report.seconds, report.nbytes / 1e6 / max(report.seconds, 1e-6),
                    len(report.bytes_by_peer), peers or "none",
                    f"; {report.parts_resumed} parts kept from before" if report.parts_resumed else "")

    def _fetcher(self, dht: DHT, model_id: str) -> Fetcher:
        loop = BackgroundLoop.shared()
        book = PeerBook(read_hosts(dht, model_id), self.config)
        book.banned = self.banned  # shared: a peer caught once is not asked again by this process
        fetcher = Fetcher(loop.run(dht.replicate_p2p()), model_id, book, self.config)
        loop.run(fetcher.connect())
        return fetcher

    # ----- the client DHT peer, started when needed and closed when idle -----------------------------------------
    def _with_dht(self, work):
        if self.dht is not None:
            return work(self.dht)
        with self._lock:
            if self._closer is not None:
                self._closer.cancel()
            if self._dht is None:
                self._dht = start_dht(replace(self.network, client_mode=True, identity_path=None,
                                              host_maddrs=NetworkConfig().host_maddrs, announce_maddrs=[]))
            try:
                return work(self._dht)
            finally:
                self._closer = threading.Timer(IDLE_CLOSE_S, self.close)
                self._closer.daemon = True
                self._closer.start()

    def close(self) -> None:
        with self._lock:
            if self._closer is not None:
                self._closer.cancel()
            if self._dht is not None:
                stop_dht(self._dht)
                self._dht = None
