"""Everything a server is configured with, in one place.

Each setting is declared once (:func:`~swarm.utils.settings.setting`: default, help text, bounds); the options of
``python -m swarm.server`` are made from these declarations (:func:`swarm.cli.options.config_options`), and
:class:`ServerConfig` checks them for Python callers too. This module imports nothing heavy, so ``--help``
answers at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from swarm.dht.config import MAX_OWNED_LIFETIME, MAX_UPDATE_PERIOD, NetworkConfig
from swarm.governance.limits import MAX_STALE_AFTER
from swarm.models.config import DEFAULT_MODEL, DTYPE_NAMES, WIRE_CHOICES
from swarm.utils.settings import check_settings, is_integer, need, setting, shown
from swarm.utils.threads import THREADS_HELP


@dataclass
class ServerConfig:
    """A server's settings (the command line only fills this in); checked on creation, a ``SettingError`` (a
    ``ValueError``) naming the field."""

    model: str = setting(DEFAULT_MODEL, "Embedded model name, checkpoint directory (native, LLaDA or Dream layout), "
                                        "Hugging Face repo id ORG/NAME[@REVISION] (then only the config, tokenizer "
                                        "and this server's shards are fetched), or a swarm model id or published "
                                        "NAME[@PUBLISHER] (then its blocks' tensors come from peers, each part "
                                        "checked against the model's manifest).",
                         path=True, cli=False)  # the command's positional MODEL or --model
    blocks: Optional[tuple[int, int]] = None  # None: choose the least-covered span (--blocks START:END)
    num_blocks: Optional[int] = setting(None, "Span length when --blocks is omitted (default: the whole model); not "
                                              "with --blocks.", low=1)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    public_name: Optional[str] = setting(None, "A name shown to users in the swarm's health map.")
    throughput: str = setting("auto", "Announced speed in tokens/s, or 'auto' to measure the span on start.")
    dht_prefix: Optional[str] = setting(None, "DHT namespace of the model (default: the model directory's name).")
    device: str = setting("cpu", "torch device to compute on: cpu, cuda or cuda:N (refused with a clear error when "
                                 "CUDA is absent).")
    dtype: Optional[str] = setting(
        None, "dtype of the hosted weights and compute. Default: the checkpoint's (bfloat16 for LLaDA / Dream, "
              "float32 for the project's own models), which gives the local model's tokens. Another dtype is "
              "announced as approximate: clients use the server only with allow_approximate.", choices=DTYPE_NAMES)
    quant: Optional[str] = setting(
        None, "Weight-only int8 quantization of the hosted blocks: about half the memory of bfloat16, not exact "
              "(announced as approximate, like --dtype).", choices=("int8",))
    head: bool = setting(
        False, "Also hold the final norm and output head (the span must end at the last block) and answer clients' "
               "head queries with the sampler's predictions instead of hidden states: the client then needs no head "
               "(at LLaDA-8B's widths about 1 GB and most of its CPU per step).")
    max_batch_tokens: int = setting(16384, "Largest batch x length accepted in one request (each sequence at most the "
                                           "model's context).", low=1)
    max_piece_tokens: int = setting(
        16384, "A forward pass of more positions x blocks than this runs in pieces between blocks, each going back to "
               "the fair order, so a small call waits for one piece, not for a whole long pass (the numbers are those "
               "of one pass: the same blocks in the same order).", low=1)
    max_concurrent_requests: int = setting(
        32, "Whole requests being computed or waiting for compute; more are refused as busy (streams still arriving "
            "count in --max-unfinished-streams instead).", low=1)
    max_queued_tokens: int = setting(
        65536, "Cost of those requests, summed, each counted at batch x length x (1 + length / S), S the length at "
               "which attention costs as much as the projections (1,024 for the default model); more are refused as "
               "busy. The same bound holds for unfinished streams.", low=1)
    peer_share: float = setting(
        0.5, "Largest share of --max-concurrent-requests, --max-queued-tokens, --max-pending-pushes and "
             "--push-memory-mb that one peer (libp2p id) may hold; its requests beyond it are refused as busy, so one "
             "client cannot take every slot. 1 turns the per-peer bound off.", low=0.0, high=1.0, low_open=True)
    max_share_per_caller: float = setting(
        1.0, "Share of this server's compute seconds over the last --share-window seconds above which a caller "
             "(libp2p id) is served after every caller within its share while others wait; it is never refused, and "
             "served at once while nobody else waits (requests are always served in fair order by caller). 1 (the "
             "default) turns it off; use is counted either way (rpc_info).",
        low=0.0, high=1.0, low_open=True)
    share_window: float = setting(
        60.0, "Seconds of the sliding window --max-share-per-caller is measured over; also the half-life of a caller's "
              "standing, the work it proved with stamps: a pass its standing covers runs in the caller's own turn, "
              "every other pass shares the one newcomers' turn.", low=1.0, high=86400.0)
    batching: bool = setting(
        True, "Compute waiting requests of several clients together: stateless forward calls of the same blocks and "
              "length that queued while the compute was busy run as one pass (up to --max-batch-tokens positions), "
              "in fair order; nothing waits for a batch to fill. Only where this server's passes are batch-invariant "
              "(checked at start on its device and announced: a merged row is then bitwise its solo pass, so no "
              "client's tokens change); elsewhere it stays off with a warning.",
        flags=("--batching",))
    batch_invariant: bool = setting(
        True, "Run every pass batch-invariant (every product 16-512 rows at a time, attention per state), so a "
              "row's numbers do not depend on what shares its call: clients batch states through this server "
              "(Picard windows, drafts) and --batching merges clients only where it is. It costs one state of "
              "16-512 positions nothing. Off (--no-batch-invariant, or SWARM_BATCH_INVARIANT=0) announces that "
              "batched states may change a token at a near-tie, so clients at scale=auto batch none here.",
        flags=("--batch-invariant",))
    max_pending_pushes: int = setting(
        32, "Pushed outputs (client option push=True) computed and not yet taken by the next server or the client; a "
            "pushed request beyond it is refused as busy before compute.", low=1)
    push_memory_mb: float = setting(
        256.0, "MiB those pushed outputs may hold (the tensor and its wire copies); a pushed request beyond it is "
               "refused as busy before compute.", low=0.0, low_open=True)
    push_timeout: float = setting(
        10.0, "Seconds a client has to take a delivered output before it is dropped and its memory freed (the next "
              "server of a pushed route has --request-timeout, as it computes first).", low=0.0, low_open=True)
    request_timeout: float = setting(60.0, "Seconds a request may take to arrive or to compute before it is failed.",
                                     low=0.0, low_open=True)
    max_unfinished_streams: int = setting(
        16, "Request streams whose parts are still arriving, over all peers (one peer at most --peer-share of them); "
            "more are refused as busy. A request takes its compute place only once it is whole.", low=1)
    receive_timeout: float = setting(
        5.0, "Seconds a request stream has to deliver all its parts, plus the time its declared size takes at "
             "--receive-rate-mb (at most --request-timeout); a stream late past it is dropped and its sender loses "
             "its record of completed requests.", low=0.0, low_open=True)
    receive_rate_mb: float = setting(1.0, "MiB/s a request stream must at least deliver: its deadline grows with its "
                                          "declared size.", low=0.0, low_open=True)
    known_peer_reserve: float = setting(
        0.25, "Share of --max-concurrent-requests and --max-unfinished-streams (and of the queued tokens) kept for "
              "peers that completed requests here: new peer ids, which cost nothing, cannot take them.",
        low=0.0, high=0.9)
    cache_memory_mb: float = setting(
        512.0, "MiB for the activation cache (per-session keys and values of cache='prefix'/'dual' clients), each "
               "version counted at its keys and values plus a measured overhead; least recently used versions are "
               "evicted.", low=0.0)
    cache_max_entries: int = setting(4096, "Activation-cache versions kept at once, whatever their size; least "
                                           "recently used are evicted.", low=1)
    cache_ttl: float = setting(300.0, "Seconds a session's activation cache is kept without being used.",
                               low=0.0, low_open=True)
    update_period: float = setting(15.0, "Seconds between DHT announcements (records expire after 2.5x).",
                                   low=0.0, low_open=True, high=MAX_UPDATE_PERIOD)
    expiration: Optional[float] = setting(None, "Seconds a DHT record lives (default: 2.5 x update_period).",
                                          low=0.0, low_open=True, high=MAX_OWNED_LIFETIME, cli=False)
    wire_dtype: str = setting(
        "auto", "dtype of returned activations. auto: the compute dtype (lossless; bfloat16 models send half float32's "
                "bytes); float16 halves float32 traffic but is not exact.", choices=WIRE_CHOICES)
    allow_backward: bool = setting(
        True, "Answer backward calls, so clients can fine-tune adapters through this server's blocks "
              "(docs/TRAINING.md). The weights never change; a backward call is bounded like a forward one and costs "
              "about three forwards of compute. --no-backward refuses them with 'no_backward'.", flags=("--backward",))
    adapter_memory_mb: float = setting(
        512.0, "MiB for adapter tensors clients sent (a LoRA's weights), kept by content digest so that their later "
               "calls name them instead of sending them again (a rank-8 LoRA at LLaDA-8B's widths is 2.6 MB per "
               "block); least recently used first, one peer at most --peer-share of it. 0 keeps none.", low=0.0)
    serve_adapters: tuple[str, ...] = setting(
        (), "Serve this adapter directory's files to clients that use it by its published name (docs/TRAINING.md, "
            "'Sharing adapters'); announced by content hash. Repeatable.", flags=("--serve-adapter",), directory=True)
    serve_weights: bool = setting(
        True, "Serve the model's bytes to peers that fetch it by swarm id or published name (docs/MODELS.md): a server "
              "of a checkpoint directory serves every tensor (its manifest is built once, hashing every byte), a "
              "server that fetched its blocks serves those. --no-serve-weights refuses.", flags=("--serve-weights",))
    serve_weights_mbps: float = setting(0.0, "Megabits per second all weight reads together may send (0: no cap).",
                                        low=0.0)
    compute_threads: Optional[int] = setting(None, THREADS_HELP, low=1, flags=("--threads", "--compute-threads"))
    governance_keys: tuple[str, ...] = setting(
        (), "Trusted governance public key (base64 or a file holding it; repeatable; default $SWARM_GOVERNANCE_KEYS). "
            "While a halt signed by one of them stands, the server refuses new steps.", flags=("--governance-key",))
    trusted_publishers: tuple[str, ...] = setting(
        (), "Publishers whose names --model NAME resolves through (base64 public keys or files holding one; "
            "repeatable, or several in one value separated by commas). Default: the governance keys; 'none' "
            "resolves no name (the model id is required). A name published by anyone else is ignored (docs/MODELS.md).",
        flags=("--trusted-publishers", "--trusted-publisher"))
    governance_poll: float = setting(2.0, "Seconds between reads of the governance records.", low=0.0, low_open=True,
                                     cli=False)
    governance_stale_after: float = setting(
        120.0, "With governance keys: seconds without reading a valid decision by them (a halt or a resume) after "
               "which the server refuses new steps until it reads one again (fail safe: a flooded or unreachable "
               "record must not look like 'running'); 0 turns it off. Publish a resume once when setting up keys.",
        low=0.0, high=MAX_STALE_AFTER)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse a setting of the wrong type or out of its declared bounds, naming it (``ServerConfig.field``)."""
        check_settings(self)
        blocks = self.blocks
        need(blocks is None or (isinstance(blocks, tuple) and len(blocks) == 2 and all(map(is_integer, blocks))
                                and 0 <= blocks[0] < blocks[1]),
             f"ServerConfig.blocks must be None or (start, end) with 0 <= start < end, got {shown(blocks)}", "blocks")
        need(self.throughput == "auto" or _is_positive_number(self.throughput),
             f"ServerConfig.throughput (--throughput) must be 'auto' or a number of tokens/s above 0, got "
             f"{shown(self.throughput)}", "throughput")
        need(isinstance(self.network, NetworkConfig),
             f"ServerConfig.network must be a NetworkConfig, got {shown(self.network)}", "network")

    @property
    def record_expiration(self) -> float:
        return self.expiration if self.expiration is not None else 2.5 * self.update_period


def _is_positive_number(text: str) -> bool:
    try:
        return float(text) > 0
    except (TypeError, ValueError):
        return False
