"""Client settings: network, timeouts, retries, bans, routing and safety, in one dataclass.

Each setting is declared once (:func:`~swarm.utils.settings.setting`: default, help text, bounds). Validation
reads the declarations; so do the client options of the command line (:func:`swarm.cli.options.config_options`
offers those declared with ``cli=True``). This module imports nothing heavy, so ``--help`` answers at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from swarm.dht.config import NetworkConfig, as_peer_list
from swarm.dht.peers import peer_id_problem
from swarm.diffusion.config import HEAD_ROWS
from swarm.governance.limits import MAX_STALE_AFTER
from swarm.models.config import DTYPE_NAMES, WIRE_CHOICES
from swarm.utils.settings import check_settings, need, setting, shown

HEAD_PLACES = ("auto", "client")  # where the output head may run (ClientConfig.head)
POSITIVE = dict(low=0.0, low_open=True)  # seconds (or a factor) above 0
AT_LEAST_0 = dict(low=0.0)


def client_network(initial_peers: "str | list[str] | tuple[str, ...]") -> NetworkConfig:
    """A client's network settings joining through ``initial_peers`` (a list, or one string of addresses)."""
    return NetworkConfig(initial_peers=as_peer_list(initial_peers), client_mode=True)


# Share of hops a client re-executes elsewhere by default (issue 48): one extra hop's compute per 20 (measured cost in
# docs/GOVERNANCE.md, "Measured"), so a server lying on every answer is caught within a generation or two.
DEFAULT_SPOT_CHECK_FRACTION = 0.05

# A server announcing over this many times the throughput a trusted auditor calibrated is routed by the calibration;
# the auditor's log, the health map and the web map flag overclaims past the same default.
DEFAULT_OVERCLAIM_FACTOR = 4.0


@dataclass
class ClientConfig:
    """A swarm client's settings; checked on creation (and again by the client), a ``SettingError`` (a
    ``ValueError``) naming the field. ``DistributedDiffusionLM.from_pretrained(**overrides)`` sets any of them."""

    network: NetworkConfig = field(default_factory=NetworkConfig)
    dht_prefix: Optional[str] = setting(None, "DHT namespace of the model (default: the model directory's name, as "
                                              "servers use).", cli=True)
    connect_timeout: float = setting(5.0, "Seconds for ping and info calls.", **POSITIVE, cli=False)
    request_timeout: float = setting(30.0, "Seconds one forward call through one server may take: the most any call "
                                           "waits.", **POSITIVE, cli=True)
    timeout_floor: float = setting(
        5.0, "Adaptive timeouts: a call waits timeout_floor + timeout_factor x the time the peer's measured speed "
             "predicts (capped by request_timeout), so a server that stops answering costs seconds, not the full "
             "timeout.", **AT_LEAST_0, cli=False)
    timeout_factor: float = setting(4.0, "See timeout_floor.", **POSITIVE, cli=False)
    max_retries: int = setting(8, "Failed calls tolerated in one denoiser call before giving up.", low=0, cli=False)
    retry_deadline: float = setting(120.0, "Seconds spent retrying one denoiser call before giving up.", **POSITIVE,
                                    cli=False)
    backoff_base: float = setting(0.1, "First retry delay in seconds; doubles on each retry.", **POSITIVE, cli=False)
    backoff_max: float = setting(5.0, "Longest retry delay in seconds.", **POSITIVE, cli=False)
    ban_base: float = setting(
        15.0, "Seconds a failing peer is avoided; doubles on repeat failures (at least 2 x request_timeout for a peer "
              "that let a call run into its timeout).", **POSITIVE, cli=False)
    ban_max: float = setting(300.0, "Longest ban in seconds.", **POSITIVE, cli=False)
    route_refresh: float = setting(30.0, "Seconds after which the server list is re-read (between generations "
                                         "only).", **AT_LEAST_0, cli=False)
    work_price: float = setting(
        16.0, "Hashes of proof of work per unit of a forward call's cost (one position), stamped on the first call "
              "to each server and on every call for a minute after it answers that one waited for another caller's: "
              "a busy server serves a caller whose calls prove their cost in a turn of its own, and every unstamped "
              "call in one turn shared by all (docs/GOVERNANCE.md). About 1 ms of CPU per small call at the default; "
              "0 sends no stamps.", low=0.0, cli=False)
    wire_dtype: str = setting("auto", "auto: the compute dtype (lossless); float16 halves float32 traffic, not exact.",
                              choices=WIRE_CHOICES, cli=False)
    dtype: Optional[str] = setting(None, "The embedding's and head's dtype; None: the checkpoint's (as servers "
                                         "default to).", choices=DTYPE_NAMES, cli=False)  # generate's --dtype
    allow_approximate: bool = setting(
        False, "Also route through servers whose numerics differ from the checkpoint's (another --dtype, --quant "
               "int8); the result then names them. Default: exact servers only.", cli=True)
    head_rows: str = setting("active", "active: the head scores only the rows the sampler reads; all: every row.",
                             choices=HEAD_ROWS, cli=False)
    head: str = setting(
        "auto", "Where the output head runs. auto: on the last server when it offers it (--head), else here; client: "
                "always here.", choices=HEAD_PLACES, cli=True)
    spot_check_fraction: float = setting(
        DEFAULT_SPOT_CHECK_FRACTION, "Share of hops (every kind of call: later steps, cache fills and reuses, head "
                                     "queries, adapters) re-executed on another server, or here when none holds the "
                                     "blocks and this checkpoint does, to compare the answers (safety tiers may raise "
                                     "it; 0 turns checks off, docs/GOVERNANCE.md).", low=0.0, high=1.0, cli=True)
    spot_check_local: bool = setting(
        True, "When no other server can check a hop and this client's checkpoint holds every block, recompute the hop "
              "here (the blocks are loaded at the first such check); otherwise the hop is reported unchecked.",
        cli=False)
    audit_share: float = setting(
        0.05, "Share of this client's calls kept with their tensors and receipts (drawn per call from os.urandom) "
              "for auditors to recompute (DistributedDiffusionLM.audit_sample; calls inside private_calls() never "
              "are; 0 keeps none). Receipts themselves are always checked and kept (docs/AUDIT.md).",
        low=0.0, high=1.0, cli=False)
    evidence_auditors: tuple[str, ...] = setting(
        (), "Peer id of an auditor this client hands its sampled calls to over libp2p (repeatable): "
            "after each generation, in the background, a random choice of up to 8 of them goes to each, with a work "
            "stamp of 16 bits apiece (a few hundredths of a second of one core; "
            "DistributedDiffusionLM.hand_audit_sample() hands them at once). Calls inside private_calls() are never "
            "sampled (docs/AUDIT.md).", flags=("--evidence-to",), cli=True)
    spot_check_memory_mb: float = setting(
        256.0, "MiB of weights this client may load to check hops itself (blocks recomputed here, the head that scores "
               "a replica's hidden states); a check needing more leaves its hop unchecked, with the reason. At "
               "LLaDA-8B's widths one block is 416 MiB and the head 988 MiB. Requests that accept only verified "
               "results (restricted) load what their checks need.", low=0.0, cli=False)
    spot_check_rtol: float = setting(1e-3, "Relative difference tolerated between two servers (float32 wire).",
                                     **POSITIVE, cli=False)
    # Which hops get checked: None draws from os.urandom (a server cannot predict it); a seed makes it reproducible
    spot_check_seed: Optional[int] = setting(None, "Seed of the spot checks' draws (None: unpredictable).", low=0,
                                             cli=False)
    trusted_peers: tuple[str, ...] = setting((), "Allow-list of peer ids for restricted requests.", cli=False)
    tier_rules_path: Optional[str] = setting(None, "JSON rules and policies for safety tiers (default rules if "
                                                   "None).", path=True, cli=False)
    governance_keys: tuple[str, ...] = setting(
        (), "Trusted governance public key (base64 or a file holding it; repeatable; default $SWARM_GOVERNANCE_KEYS). "
            "While a halt signed by one of them stands, generation stops with exit code 5.",
        flags=("--governance-key",), cli=True)
    trusted_auditors: tuple[str, ...] = setting(
        (), "Auditors whose signed reports this client follows (base64 public keys or files holding one; repeatable, "
            "or several in one value separated by commas). A server whose most recent check by one of them failed is "
            "avoided like a banned one. Default: the governance keys; 'none' trusts no auditor (docs/AUDIT.md).",
        flags=("--trusted-auditors", "--trusted-auditor"), cli=True)
    adoption_margin: float = setting(
        0.05, "adapter='best:TASK' and experts='auto' move from the adapter version they use to another only when a "
              "trusted auditor measured it better by this share of held-out problems (docs/AUDIT.md, adoption).",
        low=0.0, high=1.0, cli=False)
    trusted_publishers: tuple[str, ...] = setting(
        (), "Author ids (16 hex digits) whose adapter versions adapter='best:TASK' and experts='auto' may choose; "
            "empty: any publisher's.", cli=False)
    overclaim_factor: float = setting(
        DEFAULT_OVERCLAIM_FACTOR,
        "A server announcing over this many times the throughput a trusted auditor's measurements calibrate it to is "
        "routed by the calibrated figure instead of its own (docs/AUDIT.md).", low=1.0, high=1e6,
        cli=False)
    governance_ttl: float = setting(0.0, "Seconds a read of the halt records is reused; 0 reads before every step.",
                                    **AT_LEAST_0, cli=False)
    governance_stale_after: float = setting(
        120.0, "With trusted keys: seconds without reading a valid decision (halt or resume) after which generation "
               "stops with finish_reason 'halted' (fail safe against flooded or unreachable records); 0 turns it "
               "off.", low=0.0, high=MAX_STALE_AFTER, cli=False)
    audit_log: Optional[str] = setting(None, "JSON-lines file: one record per generation.", path=True, cli=False)
    push: bool = setting(
        False, "Servers pass activations straight to the next server (fewer network crossings): each sends its "
               "output to the next one and the last delivers it here (k + 1 crossings per pass instead of 2k). Falls "
               "back to hop-by-hop on failure; off while spot checks run (they need each hop's output).", cli=True)
    adapter_by_digest: bool = setting(
        True, "An adapter's tensor (a LoRA's weights) goes to each server once; calls after that name it by digest "
              "while the server keeps it. False sends it with every call, as servers before this did.", cli=False)
    # Benchmarks only: user-space delay of every network crossing (these machines have no netem). A call to a
    # server crosses twice (request, answer); pushed passes ask servers to delay their crossings the same way.
    inject_latency: float = setting(0.0, "Seconds per one-way network crossing (benchmarks).", **AT_LEAST_0, cli=False)
    inject_jitter: float = setting(0.0, "Extra uniform random seconds per crossing (benchmarks).", **AT_LEAST_0,
                                   cli=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse settings that would make every call fail or never time out, naming the field to change."""
        check_settings(self)
        need(isinstance(self.network, NetworkConfig),
             f"ClientConfig.network must be a NetworkConfig, got {shown(self.network)}", "network")
        problem = peer_id_problem(self.evidence_auditors, "--evidence-to")
        need(problem is None, problem or "", "evidence_auditors")
