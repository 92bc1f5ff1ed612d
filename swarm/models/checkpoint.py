"""Native checkpoint format: ``config.json`` plus safetensors, whole or sharded, readable in parts.

A sharded checkpoint has ``model.safetensors.index.json`` (the Hugging Face layout: ``weight_map`` from
tensor name to shard file). Readers open only the shards holding the tensors they ask for and read only
those tensors, so a server hosting blocks 0:8 never touches the bytes of blocks 8:16; for a model named by repo
id the other shards need not even be on disk (they are fetched only when a part reads from them).
"""
from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from swarm.models.config import ModelConfig
from swarm.models.formats import detect_format

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Brings the named files of a checkpoint directory that are not there yet (see swarm.models.hub).
Fetch = Callable[[Sequence[str]], None]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def save_checkpoint(
    directory: str | Path,
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    *,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: Optional[int] = None,
) -> Path:
    """Write ``config.json`` and the tensors; shard when ``max_shard_bytes`` is given."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        config = config.replace(torch_dtype=str(dtype).removeprefix("torch."))
    config.save(directory)
    return save_tensors(directory, tensors, dtype=dtype, max_shard_bytes=max_shard_bytes)


def save_tensors(
    directory: str | Path,
    tensors: dict[str, torch.Tensor],
    *,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: Optional[int] = None,
) -> Path:
    """Write tensors as ``model.safetensors``, or as Hugging Face shards plus ``model.safetensors.index.json``.

    Shards are filled in natural name order (``blocks.2`` before ``blocks.10``), so consecutive blocks share
    files as in published checkpoints. The config is the caller's business: formats differ there.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in tensors.items()}
    if max_shard_bytes is None:
        save_file(tensors, str(directory / SINGLE_FILE), metadata={"format": "pt"})
        return directory
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors, key=_natural_key):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return directory


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in name.split(".")]


class CheckpointReader:
    """Reads named tensors from a checkpoint directory, touching only the shards that hold them."""

    def __init__(self, directory: str | Path, rename: Callable[[str], str] = lambda name: name,
                 fetch: Optional[Fetch] = None):
        """``fetch`` brings files of ``directory`` that are not there yet (a model named by repo id: its shards
        come from the hub when a part first needs them); without it every file must already be there."""
        self.directory = Path(directory)
        self.rename = rename
        self.fetch = fetch
        index = self.directory / INDEX_FILE
        if not index.exists() and fetch is not None:
            fetch([SINGLE_FILE])  # a repo without an index holds all its weights in one file
        if index.exists():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.directory / SINGLE_FILE).exists():
            with safe_open(str(self.directory / SINGLE_FILE), framework="pt") as f:
                self.weight_map = {name: SINGLE_FILE for name in f.keys()}
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.directory}")
        self.files_opened: set[str] = set()
        self.tensors_read: set[str] = set()  # stored names, so tests can check what a span really touched

    def has(self, name: str) -> bool:
        return self.rename(name) in self.weight_map

    def read(self, names: Iterable[str], dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
        """Return {native name: tensor} for the given native names, cast to ``dtype`` when given.

        Casting happens tensor by tensor as they are read, so a bfloat16 checkpoint loaded as float32 never
        holds both copies of the whole span at once.
        """
        by_file: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for name in names:
            stored = self.rename(name)
            if stored not in self.weight_map:
                raise KeyError(f"tensor {stored!r} (for {name!r}) is not in the checkpoint at {self.directory}")
            by_file[self.weight_map[stored]].append((name, stored))
        if self.fetch is not None:
            self.fetch(list(by_file))
        out = {}
        for file_name, pairs in by_file.items():
            self.files_opened.add(file_name)
            with safe_open(str(self.directory / file_name), framework="pt") as f:
                for name, stored in pairs:
                    tensor = f.get_tensor(stored)
                    out[name] = tensor if dtype is None else tensor.to(dtype)
                    self.tensors_read.add(stored)
        return out


def load_config(directory: str | Path) -> ModelConfig:
    """The model config of a checkpoint directory in any supported format (native, LLaDA, Dream)."""
    return detect_format(directory).load_config(directory)


M = TypeVar("M", bound=nn.Module)


def load_module(
    build: Callable[[], M], reader: CheckpointReader, dtype: torch.dtype, aliases: Optional[dict[str, str]] = None
) -> M:
    """Build a module without allocating random weights, then fill it with exactly its own tensors.

    ``aliases`` maps a module parameter to another checkpoint name (tied embeddings read ``embed.weight``
    as ``lm_head.weight``).
    """
    with torch.device("meta"):
        module = build()
    aliases = aliases or {}
    wanted = {name: aliases.get(name, name) for name in module.state_dict()}
    stored = reader.read(set(wanted.values()), dtype)
    state = {name: stored[source] for name, source in wanted.items()}
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval()


def module_bytes(build: Callable[[], nn.Module], dtype: torch.dtype) -> int:
    """Bytes of the weights :func:`load_module` would load for ``build`` in ``dtype``, without reading any: what a
    caller weighs before deciding to load a part."""
    with torch.device("meta"):
        module = build()
    return sum(tensor.numel() for tensor in module.state_dict().values()) * dtype.itemsize
