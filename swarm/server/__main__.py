"""``python -m swarm.server --blocks 0:16``: host a span of a model's blocks (and/or ``--expert`` models)."""
from __future__ import annotations

import asyncio

import click

from swarm.cli_options import (
    SwarmCommand,
    default_threads,
    network_options,
    parse_span,
    pop_network_config,
    run_main,
    setup_logging,
    threads_option,
)
from swarm.dht.node import NetworkConfig
from swarm.dht.peers import resolve_initial_peers
from swarm.protocol import WIRE_CHOICES
from swarm.server.config import ServerConfig
from swarm.server.server import Server


def join_message(network: NetworkConfig, addrs: list[str]) -> str:
    """How this server joined, from the peers it really used (``--initial-peers``, else $SWARM_INITIAL_PEERS, else
    the bootstrap file): only a server that had none started a new swarm whose address others need."""
    peers = resolve_initial_peers(network.initial_peers, use_defaults=network.use_default_peers)
    if peers:
        return f"Joined the swarm through {len(peers)} initial peer(s); this server listens on {' '.join(addrs)}"
    return f"Started a new swarm. Others join with: --initial-peers {' '.join(addrs)}"


def print_ready(server: Server) -> None:
    from swarm.dht.node import visible_maddrs

    addrs = visible_maddrs(server.dht)
    click.echo(join_message(server.config.network, addrs), err=True)
    # One machine-readable line on stdout, so scripts and tests can wait for readiness.
    blocks = f" blocks={server.start}:{server.end}" if server.hosts_blocks else ""
    experts = f" experts={','.join(sorted(server.experts))}" if server.experts else ""
    click.echo(f"SERVER READY peer_id={server.peer_id}{blocks} maddrs={','.join(addrs)}{experts}")


@click.command(cls=SwarmCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--model", default="default",
              help="Embedded model name, checkpoint directory (native, LLaDA or Dream layout) or Hugging Face repo "
                   "id ORG/NAME[@REVISION]: then only the config, tokenizer and this server's shards are fetched.")
@click.option("--blocks", default=None,
              help="Blocks to host as START:END (end exclusive), e.g. 0:16. Omitted: the least-covered span of "
                   "--num-blocks.")
@click.option("--num-blocks", type=click.IntRange(min=1), default=None,
              help="Span length when --blocks is omitted (default: the whole model); not with --blocks.")
@click.option("--expert", "experts", multiple=True,
              help="Also host a whole expert model: an embedded name (code, addition) or a checkpoint directory, "
                   "optionally as DOMAIN=NAME_OR_PATH; clients ask for it by DOMAIN (default: the model's directory "
                   "name). Repeatable. It must share --model's tokenizer, vocabulary and mask token. With --expert "
                   "and neither --blocks nor --num-blocks, the server hosts only experts.")
@network_options
@click.option("--public-name", default=None, help="A name shown to users in the swarm's health map.")
@click.option("--throughput", default="auto",
              help="Announced speed in tokens/s, or 'auto' to measure the span on start.")
@click.option("--dht-prefix", default=None, help="DHT namespace of the model (default: the model directory's name).")
@click.option("--device", default="cpu",
              help="torch device to compute on: cpu, cuda or cuda:N (refused with a clear error when CUDA is absent).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="dtype of the hosted weights and compute. Default: the checkpoint's (bfloat16 for LLaDA / Dream, "
                   "float32 for the project's own models), which gives the local model's tokens. Another dtype is "
                   "announced as approximate: clients use the server only with allow_approximate.")
@click.option("--quant", type=click.Choice(["int8"]), default=None,
              help="Weight-only int8 quantization of the hosted blocks: about half the memory of bfloat16, not exact "
                   "(announced as approximate, like --dtype).")
@click.option("--head", is_flag=True, default=False,
              help="Also hold the final norm and output head (the span must end at the last block) and answer "
                   "clients' head queries with the sampler's predictions instead of hidden states: the client then "
                   "needs no head (at LLaDA-8B's widths about 1 GB and most of its CPU per step).")
@click.option("--max-batch-tokens", type=click.IntRange(min=1), default=ServerConfig.max_batch_tokens,
              help="Largest batch x length accepted in one request (each sequence at most the model's context).")
@click.option("--max-concurrent-requests", type=click.IntRange(min=1), default=ServerConfig.max_concurrent_requests,
              help="Whole requests being computed or waiting for compute; more are refused as busy (streams still "
                   "arriving count in --max-unfinished-streams instead).")
@click.option("--max-queued-tokens", type=click.IntRange(min=1), default=ServerConfig.max_queued_tokens,
              help="Cost of those requests, summed, each counted at batch x length x (1 + length / S), S the length "
                   "at which attention costs as much as the projections (1,024 for the default model); more are "
                   "refused as busy. The same bound holds for unfinished streams.")
@click.option("--peer-share", type=click.FloatRange(min=0, max=1, min_open=True), default=ServerConfig.peer_share,
              help="Largest share of --max-concurrent-requests, --max-queued-tokens, --max-pending-pushes and "
                   "--push-memory-mb that one peer (libp2p id) may hold; its requests beyond it are refused as "
                   "busy, so one client cannot take every slot. 1 turns the per-peer bound off.")
@click.option("--max-pending-pushes", type=click.IntRange(min=1), default=ServerConfig.max_pending_pushes,
              help="Pushed outputs (client option push=True) computed and not yet taken by the next server or the "
                   "client; a pushed request beyond it is refused as busy before compute.")
@click.option("--push-memory-mb", type=click.FloatRange(min=0, min_open=True), default=ServerConfig.push_memory_mb,
              help="MiB those pushed outputs may hold (the tensor and its wire copies); a pushed request beyond it "
                   "is refused as busy before compute.")
@click.option("--push-timeout", type=click.FloatRange(min=0, min_open=True), default=ServerConfig.push_timeout,
              help="Seconds a client has to take a delivered output before it is dropped and its memory freed "
                   "(the next server of a pushed route has --request-timeout, as it computes first).")
@click.option("--request-timeout", type=float, default=ServerConfig.request_timeout,
              help="Seconds a request may take to arrive or to compute before it is failed.")
@click.option("--max-unfinished-streams", type=click.IntRange(min=1), default=ServerConfig.max_unfinished_streams,
              help="Request streams whose parts are still arriving, over all peers (one peer at most --peer-share "
                   "of them); more are refused as busy. A request takes its compute place only once it is whole.")
@click.option("--receive-timeout", type=click.FloatRange(min=0, min_open=True), default=ServerConfig.receive_timeout,
              help="Seconds a request stream has to deliver all its parts, plus the time its declared size takes at "
                   "--receive-rate-mb (at most --request-timeout); a stream late past it is dropped and its sender "
                   "loses its record of completed requests.")
@click.option("--receive-rate-mb", type=click.FloatRange(min=0, min_open=True), default=ServerConfig.receive_rate_mb,
              help="MiB/s a request stream must at least deliver: its deadline grows with its declared size.")
@click.option("--known-peer-reserve", type=click.FloatRange(min=0, max=0.9), default=ServerConfig.known_peer_reserve,
              help="Share of --max-concurrent-requests and --max-unfinished-streams (and of the queued tokens) kept "
                   "for peers that completed requests here: new peer ids, which cost nothing, cannot take them.")
@click.option("--cache-memory-mb", type=click.FloatRange(min=0), default=ServerConfig.cache_memory_mb,
              help="MiB for the activation cache (per-session keys and values of cache='prefix'/'dual' clients), "
                   "each version counted at its keys and values plus a measured overhead; least recently used "
                   "versions are evicted.")
@click.option("--cache-max-entries", type=click.IntRange(min=1), default=ServerConfig.cache_max_entries,
              help="Activation-cache versions kept at once, whatever their size; least recently used are evicted.")
@click.option("--cache-ttl", type=click.FloatRange(min=0, min_open=True), default=ServerConfig.cache_ttl,
              help="Seconds a session's activation cache is kept without being used.")
@click.option("--update-period", type=float, default=ServerConfig.update_period,
              help="Seconds between DHT announcements (records expire after 2.5x).")
@click.option("--wire-dtype", type=click.Choice(WIRE_CHOICES), default=ServerConfig.wire_dtype,
              help="dtype of returned activations. auto: the compute dtype (lossless; bfloat16 models send half "
                   "float32's bytes); float16 halves float32 traffic but is not exact.")
@click.option("--backward/--no-backward", "allow_backward", default=ServerConfig.allow_backward,
              help="Answer backward calls, so clients can fine-tune adapters through this server's blocks "
                   "(docs/TRAINING.md). The weights never change; a backward call is bounded like a forward one "
                   "and costs about three forwards of compute. --no-backward refuses them with 'no_backward'.")
@click.option("--adapter-memory-mb", type=click.FloatRange(min=0), default=ServerConfig.adapter_memory_mb,
              help="MiB for adapter tensors clients sent (a LoRA's weights), kept by content digest so that their "
                   "later calls name them instead of sending them again (a rank-8 LoRA at LLaDA-8B's widths is "
                   "2.6 MB per block); least recently used first, one peer at most --peer-share of it. 0 keeps none.")
@click.option("--serve-adapter", "serve_adapters", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="Serve this adapter directory's files to clients that use it by its published name "
                   "(docs/TRAINING.md, 'Sharing adapters'); announced by content hash. Repeatable.")
@threads_option("--compute-threads", dest="compute_threads")
@click.option("--governance-key", "governance_keys", multiple=True,
              help="Trusted governance public key (base64 or a file holding it; repeatable; default "
                   "$SWARM_GOVERNANCE_KEYS). While a halt signed by one of them stands, the server refuses new steps.")
@click.option("--governance-stale-after", type=click.FloatRange(0, 7 * 24 * 3600.0), default=120.0, show_default=True,
              help="With governance keys: seconds without reading a valid decision by them (a halt or a resume) after "
                   "which the server refuses new steps until it reads one again (fail safe: a flooded or unreachable "
                   "record must not look like 'running'); 0 turns it off. Publish a resume once when setting up keys.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING"]), default="INFO", help="Logging verbosity.")
def main(blocks: str | None, experts: tuple[str, ...], log_level: str, **options) -> None:
    """Host a span of a model's transformer blocks and/or expert models, and announce them on the swarm's DHT.

    Errors end in one line and an exit code (docs/OPERATIONS.md): 2 a bad value, 3 the swarm cannot be joined,
    4 a port in --host-maddrs (or the identity) is in use."""
    setup_logging(log_level)
    network = pop_network_config(options)
    options["compute_threads"] = options["compute_threads"] or default_threads()
    config = ServerConfig(blocks=parse_span(blocks), network=network, **options)
    server = Server(config, experts)
    asyncio.run(server.serve(on_ready=print_ready))


if __name__ == "__main__":
    run_main(main)
