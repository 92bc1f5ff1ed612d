"""Client settings: network, timeouts, retries and bans, in one dataclass."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from swarm.dht.node import NetworkConfig
from swarm.governance.records import check_stale_after

HEAD_PLACES = ("auto", "client")  # where the output head may run (ClientConfig.head)


def client_network(initial_peers: list[str]) -> NetworkConfig:
    return NetworkConfig(initial_peers=list(initial_peers), client_mode=True)


@dataclass
class ClientConfig:
    network: NetworkConfig = field(default_factory=NetworkConfig)
    dht_prefix: Optional[str] = None  # default: the model directory's name, as servers use
    connect_timeout: float = 5.0  # ping / info calls
    request_timeout: float = 30.0  # one forward call through one server: the most any call waits
    # Adaptive timeouts: a call waits timeout_floor + timeout_factor x the time the peer's measured speed predicts
    # (capped by request_timeout), so a server that stops answering costs seconds, not the full timeout.
    timeout_floor: float = 5.0
    timeout_factor: float = 4.0
    max_retries: int = 8  # failed calls tolerated in one denoiser call before giving up
    retry_deadline: float = 120.0  # seconds spent retrying one denoiser call before giving up
    backoff_base: float = 0.1  # first retry delay; doubles on each retry
    backoff_max: float = 5.0
    # seconds a failing peer is avoided; doubles on repeat failures (at least 2 x request_timeout for a peer that
    # let a call run into its timeout)
    ban_base: float = 15.0
    ban_max: float = 300.0
    route_refresh: float = 30.0  # seconds after which the server list is re-read (between generations only)
    wire_dtype: str = "auto"  # "auto": the compute dtype (lossless); "float16" halves float32 traffic, not exact
    dtype: Optional[str] = None  # the embedding's and head's dtype; None: the checkpoint's (as servers default to)
    # Servers whose numerics differ from the checkpoint's (another --dtype, --quant int8) announce it; routes
    # avoid them unless this is set, and results then name each approximate hop in info["approximate"].
    allow_approximate: bool = False
    head_rows: str = "active"  # "active": the head scores only the rows the sampler reads; "all": every row
    # Where the output head runs: "auto" on a server at the route's end that offers it (``--head``), which then
    # answers the sampler's predictions (the client loads no head), else in this client; "client": always here.
    head: str = "auto"
    spot_check_fraction: float = 0.0  # share of hops re-executed on another server (tiers may raise it)
    spot_check_rtol: float = 1e-3  # relative difference tolerated between two servers (float32 wire)
    # Which hops get checked: None draws from os.urandom (a server cannot predict it); a seed makes it reproducible
    spot_check_seed: Optional[int] = None
    trusted_peers: tuple[str, ...] = ()  # allow-list of peer ids for restricted requests
    tier_rules_path: Optional[str] = None  # JSON rules and policies for safety tiers (default rules if None)
    governance_keys: tuple[str, ...] = ()  # trusted governance public keys (also $SWARM_GOVERNANCE_KEYS)
    governance_ttl: float = 0.0  # seconds a read of the halt records is reused; 0 reads before every step
    # With trusted keys: seconds without reading a valid decision (halt or resume) after which generation stops
    # with finish_reason "halted" (fail safe against flooded or unreachable records); 0 turns it off.
    governance_stale_after: float = 120.0
    audit_log: Optional[str] = None  # JSON-lines file: one record per generation
    # Server-to-server push: each server sends its output straight to the next one and the last delivers it
    # to this client (k + 1 network crossings per pass instead of 2k). Falls back to hop-by-hop on failure;
    # off while spot checks run (they need each hop's output).
    push: bool = False
    # An adapter's tensor (a LoRA's weights) goes to each server once; calls after that name it by digest while
    # the server keeps it (it says so when it does). False sends it with every call, as servers before this did.
    adapter_by_digest: bool = True
    # Benchmarks only: user-space delay of every network crossing (these machines have no netem). A call to a
    # server crosses twice (request, answer); pushed passes ask servers to delay their crossings the same way.
    inject_latency: float = 0.0  # seconds per one-way crossing
    inject_jitter: float = 0.0  # extra uniform random seconds per crossing

    def validate(self) -> None:
        """Refuse settings that would make every call fail or never time out, with the field to change."""
        positive = ("connect_timeout", "request_timeout", "timeout_factor", "retry_deadline", "backoff_base",
                    "backoff_max", "ban_base", "ban_max")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ClientConfig.{name} must be a positive number of seconds (or factor), "
                                 f"got {value!r}")
        check_stale_after(self.governance_stale_after, "ClientConfig.governance_stale_after")
        for name in ("timeout_floor", "route_refresh", "inject_latency", "inject_jitter"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"ClientConfig.{name} must be >= 0 seconds, got {value!r}")
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"ClientConfig.max_retries must be an integer >= 0, got {self.max_retries!r}")
        if self.head not in HEAD_PLACES:
            raise ValueError(f"ClientConfig.head must be one of {HEAD_PLACES}, got {self.head!r}")
        if not 0 <= self.spot_check_fraction <= 1:
            raise ValueError(f"ClientConfig.spot_check_fraction must be in [0, 1], got {self.spot_check_fraction!r}")
