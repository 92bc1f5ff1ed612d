"""Everything a server is configured with, in one place (the CLI only fills this in)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from swarm.dht.node import NetworkConfig


@dataclass
class ServerConfig:
    model: str = "default"
    blocks: Optional[tuple[int, int]] = None  # None: choose the least-covered span
    num_blocks: Optional[int] = None  # span length when choosing automatically (default: whole model)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    dht_prefix: Optional[str] = None  # default: the model's name
    public_name: Optional[str] = None
    throughput: str = "auto"  # "auto" measures on start, or a number of tokens/s
    device: str = "cpu"  # "cuda", "cuda:1": checked on start (a clear error when CUDA is absent)
    dtype: Optional[str] = None  # None: the checkpoint's (ModelFiles.default_dtype); another is announced approximate
    quant: Optional[str] = None  # "int8": weight-only quantization of the span (smaller, not exact)
    head: bool = False  # also hold the final norm and output head (last block only) and answer head queries
    max_batch_tokens: int = 16384  # batch * length of one request
    max_concurrent_requests: int = 32  # whole requests in compute or waiting for it; more get a BUSY error
    max_queued_tokens: int = 65536  # their cost summed: batch x length x (1 + length / attention's scale)
    peer_share: float = 0.5  # share of the request, token and push bounds one peer (libp2p id) may hold
    max_pending_pushes: int = 32  # pushed outputs not yet taken by the next hop or the client
    push_memory_mb: float = 256.0  # their memory (tensor and wire copies)
    push_timeout: float = 10.0  # seconds a client has to take a delivered output before it is dropped
    request_timeout: float = 60.0
    max_unfinished_streams: int = 16  # request streams whose parts are still arriving (over all peers)
    receive_timeout: float = 5.0  # seconds a stream has to deliver its parts, beyond receive_rate_mb's time
    receive_rate_mb: float = 1.0  # MiB/s a stream must at least deliver: its deadline grows with its declared size
    known_peer_reserve: float = 0.25  # share of request and stream places kept for peers that completed requests
    cache_memory_mb: float = 512.0  # activation cache (keys and values of sessions), least recently used evicted
    cache_max_entries: int = 4096  # cache versions kept at once, whatever their size
    cache_ttl: float = 300.0  # seconds a session's cache survives without being used
    governance_keys: tuple[str, ...] = ()  # trusted governance public keys (also $SWARM_GOVERNANCE_KEYS)
    governance_poll: float = 2.0  # seconds between reads of the governance records
    # With trusted keys: seconds without reading a valid decision after which the server refuses new steps (fail
    # safe: the records may be flooded or the DHT unreachable); 0 turns it off. Publish a resume once at set-up.
    governance_stale_after: float = 120.0
    update_period: float = 15.0  # seconds between DHT announcements
    expiration: Optional[float] = None  # record lifetime; default 2.5 x update_period
    allow_backward: bool = True  # answer backward calls (fine-tuning through the swarm; weights stay frozen)
    adapter_memory_mb: float = 512.0  # adapter tensors clients sent, kept so later calls name them (0: none kept)
    serve_adapters: tuple[str, ...] = ()  # adapter directories whose files this server serves (by content hash)
    wire_dtype: str = "auto"  # "auto": the compute dtype (lossless); "float16" halves float32's bytes (not exact)
    compute_threads: Optional[int] = None

    @property
    def record_expiration(self) -> float:
        return self.expiration if self.expiration is not None else 2.5 * self.update_period
