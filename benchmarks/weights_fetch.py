"""A server that names its model by swarm id, with an empty cache: what it fetches from peers, how fast, and how long
until it serves.

Builds a checkpoint in LLaDA's published layout (random bfloat16 weights, one block per shard), starts a bootstrap
peer and ``--publishers`` servers of that directory on 127.0.0.1 (each serves every tensor of it, as servers do by
default), then starts ``python -m swarm.server --model ID --blocks START:END`` and measures:

* the bytes it fetched (the tensor files in its cache) against the whole checkpoint;
* the peer-to-peer fetch rate (its own log line: bytes and seconds of the fetch, every part hashed and written)
  against a plain copy of the same blocks' shard files on the same disk;
* the seconds from starting the command to its SERVER READY line (Python start-up, the manifest and config from
  peers, the fetch, loading the span, joining the DHT).

    python benchmarks/weights_fetch.py                    # LLaDA-8B widths, 4 blocks (3.9 GB), span 2:4
    python benchmarks/weights_fetch.py --widths tiny      # the test checkpoint's widths (seconds)

With ``--tarpits N`` it measures instead what tarpits cost a fetch (issue 48): N hosts sending correct bytes just
before the reader's deadline, beside one honest host, all on 127.0.0.1 (in this process, no DHT). It fetches every
tensor of the blocks of ``--span`` three times, into fresh caches: from the honest host alone, with the tarpits
(hedging on, the default), and with the tarpits and hedging off (the fetch before issue 48), and prints the seconds
side by side with their ratio to the honest fetch:

    python benchmarks/weights_fetch.py --widths tiny --tarpits 4
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from huggingface_hub import constants  # noqa: E402

from benchmarks.hub_fetch import WIDTHS  # noqa: E402
from swarm.dht.node import NetworkConfig, create_p2p, start_dht, stop_dht  # noqa: E402
from swarm.models.checkpoint import save_tensors  # noqa: E402
from swarm.models.published import LLADA_CONFIG, llada_shapes  # noqa: E402
from swarm.utils.local_swarm import LocalSwarm  # noqa: E402
from swarm.weights.holdings import built_manifest  # noqa: E402
from swarm.weights.manifest import weight_files  # noqa: E402
from swarm.weights.records import read_hosts  # noqa: E402

FETCHED = re.compile(r"fetched ([\d.]+) MB of model \S+ in ([\d.]+) s \(([\d.]+) MB/s\) from (\d+) peers")


def build(directory: Path, widths: str, num_blocks: int) -> int:
    """Write the checkpoint (random bfloat16, one block per shard); returns the bytes of its shard files."""
    config = dict(LLADA_CONFIG, **WIDTHS[widths], n_layers=num_blocks, torch_dtype="bfloat16")
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator).to(torch.bfloat16)
               for name, shape in llada_shapes(config).items()}
    block = sum(t.numel() * 2 for name, t in tensors.items() if ".blocks.0." in name)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_tensors(directory, tensors, max_shard_bytes=block)
    return sum(path.stat().st_size for path in directory.glob("*.safetensors"))


def copy_seconds(directory: Path, files: set[str], target: Path) -> tuple[int, float]:
    """Bytes and seconds of a plain copy of ``files`` (fsynced, as the fetch's files are)."""
    target.mkdir(parents=True, exist_ok=True)
    started, total = time.monotonic(), 0
    for name in sorted(files):
        shutil.copyfile(directory / name, target / name)
        with open(target / name, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        total += (target / name).stat().st_size
    return total, time.monotonic() - started


def tarpit_fetch(checkpoint: Path, cache_root: Path, indices: list[int], tarpits: int, config) -> tuple:
    """Seconds, report and peer book of one fetch of ``indices`` from an honest host and ``tarpits`` tarpits."""
    from swarm.testing.tarpit import start_host
    from swarm.utils.event_loop import BackgroundLoop
    from swarm.weights.cache import ModelCache
    from swarm.weights.fetch import Fetcher, PeerBook

    loop = BackgroundLoop.shared()
    hosts = [start_host(checkpoint, config.timeout - 1.0) for _ in range(tarpits)] + [start_host(checkpoint)]
    client = loop.run(create_p2p(), timeout=60)
    try:
        manifest = hosts[-1].server.holdings.manifest
        cache = ModelCache(manifest.model_id, cache_root)
        cache.install(manifest.to_bytes(), manifest, {f.name: (checkpoint / f.name).read_bytes()
                                                      for f in manifest.files})
        fetcher = Fetcher(client, manifest.model_id, PeerBook([h.record for h in hosts], config), config)
        loop.run(fetcher.connect())
        started = time.monotonic()
        report = loop.run(fetcher.fetch_tensors(manifest, cache, indices))
        return time.monotonic() - started, report, fetcher.book, hosts[-1].record.peer_id
    finally:
        loop.run(client.shutdown())
        for host in hosts:
            host.stop()


def tarpit_main(args, checkpoint: Path, root: Path) -> None:
    from swarm.weights.fetch import FetchConfig

    start, end = (int(x) for x in args.span.split(":"))
    manifest = built_manifest(checkpoint.resolve(), weight_files(checkpoint))
    indices = [i for i, t in enumerate(manifest.tensors) if any(f".blocks.{b}." in t.name for b in range(start, end))]
    nbytes = sum(manifest.tensors[i].size for i in indices)
    runs = [("honest host alone", 0, FetchConfig()),
            (f"+ {args.tarpits} tarpits, hedged (default)", args.tarpits, FetchConfig()),
            (f"+ {args.tarpits} tarpits, hedging off (before)", args.tarpits, FetchConfig(hedge_after=float("inf")))]
    print(f"fetching {len(indices)} tensors ({nbytes:,} bytes) of blocks {args.span}; a tarpit answers each read "
          f"{FetchConfig().timeout - 1.0:.0f} s late (the reader's deadline is {FetchConfig().timeout:.0f} s + bytes "
          f"at 1 MiB/s)")
    print(f"{'fetch':<40} {'seconds':>8} {'x honest':>9} {'hedges':>7} {'from tarpits':>13} {'dropped':>8}")
    honest_seconds = None
    for number, (label, tarpits, config) in enumerate(runs):
        seconds, report, book, honest = tarpit_fetch(checkpoint, root / f"cache-{number}", indices, tarpits, config)
        honest_seconds = honest_seconds or seconds
        from_tarpits = sum(n for peer, n in report.bytes_by_peer.items() if peer != honest)
        print(f"{label:<40} {seconds:>8.2f} {seconds / honest_seconds:>9.1f} {report.hedges:>7} "
              f"{from_tarpits:>13,} {len(book.dropped):>8}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", choices=sorted(WIDTHS), default="8b")
    parser.add_argument("--blocks", type=int, default=4, help="blocks in the checkpoint")
    parser.add_argument("--span", default="2:4", help="the new server's blocks, START:END")
    parser.add_argument("--publishers", type=int, default=2, help="servers of the checkpoint directory")
    parser.add_argument("--scratch", default=None, help="directory for the checkpoint and caches (default: /tmp)")
    parser.add_argument("--tarpits", type=int, default=0, help="measure instead a fetch beside this many tarpits")
    args = parser.parse_args()
    start, end = (int(x) for x in args.span.split(":"))
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        root = Path(scratch)
        checkpoint, home = root / "llada", root / "home"
        total = build(checkpoint, args.widths, args.blocks)
        constants.HF_HOME = str(home)
        if args.tarpits:
            return tarpit_main(args, checkpoint, root)
        started = time.monotonic()
        manifest = built_manifest(checkpoint.resolve(), weight_files(checkpoint))
        hash_seconds = time.monotonic() - started
        print(f"checkpoint: LLaDA layout, {args.widths} widths, {args.blocks} blocks, bfloat16: {total:,} bytes; "
              f"manifest {len(manifest.to_bytes()):,} bytes, built in {hash_seconds:.1f} s (every byte hashed)")
        with LocalSwarm(env={"HF_HOME": str(home), "PYTHONPATH": str(ROOT)}, startup_timeout=900) as swarm:
            swarm.start_bootstrap()
            publishers = [swarm.start_server(str(checkpoint), "0:1", "--compute-threads", "1", wait=False,
                                             name=f"publisher-{i}") for i in range(args.publishers)]
            for publisher in publishers:
                swarm.wait_ready(publisher)
            dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers, client_mode=True))
            try:
                deadline = time.monotonic() + 300
                while len(read_hosts(dht, manifest.model_id)) < args.publishers and time.monotonic() < deadline:
                    time.sleep(1)
            finally:
                stop_dht(dht)
            started = time.monotonic()
            server = swarm.start_server(manifest.model_id, args.span, "--compute-threads", "2", name="by-id")
            ready_seconds = time.monotonic() - started
            cached = home / "swarm" / "weights" / manifest.model_id / manifest.name
            fetched = sum(p.stat().st_size for p in cached.glob("t-*.safetensors"))
            line = next((m for m in map(FETCHED.search, server.log) if m), None)
        names = {t.file for t in manifest.tensors if any(f".blocks.{b}." in t.name for b in range(start, end))}
        copied, copy_s = copy_seconds(checkpoint, names, root / "copy")
    whole = sum(t.size for t in manifest.tensors)
    print(f"{'measure':<52} {'value':>22}")
    print(f"{'checkpoint tensors (bytes)':<52} {whole:>22,}")
    print(f"{f'fetched by a server of blocks {args.span} (bytes)':<52} {fetched:>22,}  ({fetched / whole:.1%})")
    if line:
        mb, seconds, rate, peers = line.groups()
        print(f"{f'peer-to-peer fetch, {peers} peers, loopback (MB/s)':<52} {float(rate):>22.1f}  "
              f"({mb} MB in {seconds} s)")
    print(f"{'plain copy of the same shards, same disk (MB/s)':<52} {copied / 1e6 / copy_s:>22.1f}  "
          f"({copied / 1e6:.1f} MB in {copy_s:.1f} s)")
    print(f"{'swarm.server --model ID to SERVER READY, empty cache (s)':<52} {ready_seconds:>22.1f}")


if __name__ == "__main__":
    main()
