"""Client settings: network, timeouts, retries and bans, in one dataclass."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from swarm.dht.node import NetworkConfig


def client_network(initial_peers: list[str]) -> NetworkConfig:
    return NetworkConfig(initial_peers=list(initial_peers), client_mode=True)


@dataclass
class ClientConfig:
    network: NetworkConfig = field(default_factory=NetworkConfig)
    dht_prefix: Optional[str] = None  # default: the model directory's name, as servers use
    connect_timeout: float = 5.0  # ping / info calls
    request_timeout: float = 30.0  # one forward call through one server
    max_retries: int = 8  # failed calls tolerated in one denoiser call before giving up
    retry_deadline: float = 120.0  # seconds spent retrying one denoiser call before giving up
    backoff_base: float = 0.1  # first retry delay; doubles on each retry
    backoff_max: float = 5.0
    ban_base: float = 15.0  # seconds a failing peer is avoided; doubles on repeat failures
    ban_max: float = 300.0
    route_refresh: float = 30.0  # seconds after which the server list is re-read (between generations only)
    wire_dtype: str = "float32"  # "float16" halves traffic but is not exact
    spot_check_fraction: float = 0.0  # share of hops re-executed on another server (tiers may raise it)
    spot_check_rtol: float = 1e-3  # relative difference tolerated between two servers (float32 wire)
    spot_check_seed: int = 0  # which hops get checked is drawn from this seed: reproducible
    trusted_peers: tuple[str, ...] = ()  # allow-list of peer ids for restricted requests
    tier_rules_path: Optional[str] = None  # JSON rules and policies for safety tiers (default rules if None)
    governance_keys: tuple[str, ...] = ()  # trusted governance public keys (also $SWARM_GOVERNANCE_KEYS)
    governance_ttl: float = 0.0  # seconds a read of the halt records is reused; 0 reads before every step
    audit_log: Optional[str] = None  # JSON-lines file: one record per generation
    # Server-to-server push: each server sends its output straight to the next one and the last delivers it
    # to this client (k + 1 network crossings per pass instead of 2k). Falls back to hop-by-hop on failure;
    # off while spot checks run (they need each hop's output).
    push: bool = False
    # Benchmarks only: user-space delay of every network crossing (these machines have no netem). A call to a
    # server crosses twice (request, answer); pushed passes ask servers to delay their crossings the same way.
    inject_latency: float = 0.0  # seconds per one-way crossing
    inject_jitter: float = 0.0  # extra uniform random seconds per crossing
