"""Bytes a server and a client download when they name a model by repo id, against the whole checkpoint.

Builds a checkpoint in LLaDA's published layout (config keys, tensor names, bfloat16, sharded with
``model.safetensors.index.json``, one block per shard), serves it from the local hub stand-in
(swarm/testing/hub_standin.py) on 127.0.0.1, and, with a fresh Hugging Face cache each, lets ``huggingface_hub`` fetch:
a server of blocks START:END (``ModelFiles(repo).span``), a server that also holds the head, and a client
(config, tokenizer, embedding). The stand-in counts the bytes it sends. Weights are zeros: the byte counts do not
depend on the values, and zeros are quick to write.

    python benchmarks/hub_fetch.py                    # LLaDA-8B widths, 4 blocks (3.9 GB on disk), span 0:2
    python benchmarks/hub_fetch.py --widths tiny      # the test checkpoint's widths (seconds)
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from huggingface_hub import constants  # noqa: E402

from swarm.models.checkpoint import save_tensors  # noqa: E402
from swarm.models.loading import ModelFiles  # noqa: E402
from swarm.models.published import LLADA_8B_WIDTHS, LLADA_CONFIG, llada_shapes  # noqa: E402
from swarm.testing.hub_standin import HubStandin  # noqa: E402

REPO = "bench/llada"
WIDTHS = {"8b": LLADA_8B_WIDTHS, "tiny": {}}  # LLaDA-8B-Instruct's published widths, and the tests' tiny ones


def build(directory: Path, widths: str, num_blocks: int) -> int:
    """Write the checkpoint; returns the bytes of its shard files (what downloading all of it costs)."""
    config = dict(LLADA_CONFIG, **WIDTHS[widths], n_layers=num_blocks, torch_dtype="bfloat16")
    tensors = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in llada_shapes(config).items()}
    block = sum(t.numel() * 2 for name, t in tensors.items() if ".blocks.0." in name)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_tensors(directory, tensors, max_shard_bytes=block)  # one block per shard, the embedding and head alone
    return sum(path.stat().st_size for path in directory.glob("*.safetensors"))


def fetched(hub: HubStandin, home: Path, role: Callable[[ModelFiles], object]) -> tuple[int, float]:
    """Bytes of weights the stand-in sent while ``role`` loaded its parts from an empty cache, and seconds."""
    constants.HF_HOME, constants.HF_HUB_CACHE = str(home), str(home / "hub")
    hub.reset_counts()
    started = time.monotonic()
    role(ModelFiles(REPO))
    seconds = time.monotonic() - started
    return sum(n for name, n in hub.bytes_served().items() if name.endswith(".safetensors")), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", choices=sorted(WIDTHS), default="8b")
    parser.add_argument("--blocks", type=int, default=4, help="blocks in the checkpoint")
    parser.add_argument("--span", default="0:2", help="the server's blocks, START:END")
    args = parser.parse_args()
    start, end = (int(x) for x in args.span.split(":"))
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as scratch, HubStandin() as hub:
        root = Path(scratch)
        total = build(root / "repo", args.widths, args.blocks)
        hub.add_repo(REPO, root / "repo")
        constants.ENDPOINT = hub.url
        constants.HUGGINGFACE_CO_URL_TEMPLATE = hub.url + "/{repo_id}/resolve/{revision}/{filename}"
        roles = {
            f"server --blocks {start}:{end}": lambda files: files.span(start, end),
            f"server --blocks {start}:{end} --head": lambda files: (files.span(start, end), files.head()),
            "client (embedding)": lambda files: files.embedding(),
        }
        print(f"checkpoint: LLaDA layout, {args.widths} widths, {args.blocks} blocks, bfloat16: "
              f"{total:,} bytes in {args.blocks + 3} shards")
        print(f"{'role':<32} {'weights fetched (bytes)':>24} {'of checkpoint':>14} {'seconds':>8}")
        for i, (role, load) in enumerate(roles.items()):
            nbytes, seconds = fetched(hub, root / f"home{i}", load)
            print(f"{role:<32} {nbytes:>24,} {nbytes / total:>14.1%} {seconds:>8.1f}")


if __name__ == "__main__":
    main()
