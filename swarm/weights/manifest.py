"""A model's manifest: every byte of it named by a hash, so that any peer may serve it and none can change it.

The manifest lists the small files (config, tokenizer files, sampler defaults) with their size and SHA-256, and
every tensor of the safetensors files with its name, dtype, shape, the publisher's file and byte range, its
SHA-256, and the SHA-256 of each of its parts (a tensor is fetched and checked part by part, from several peers:
a wrong byte is caught in the part it is in, and the peer that sent it is known). Its canonical JSON bytes
hash to the **model id**; whoever names the id names exactly these bytes.

A manifest comes from the network: :meth:`Manifest.from_bytes` checks every field and bound, and names in it
are never used as paths (the cache names its files itself, :mod:`swarm.weights.cache`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from swarm.models.checkpoint import INDEX_FILE, SINGLE_FILE
from swarm.models.config import CONFIG_FILE
from swarm.models.formats import detect_format
from swarm.models.hub import OPTIONAL_FILES
from swarm.models.modules import DiffusionTransformer
from swarm.utils.errors import EXIT_USAGE, SwarmError

logger = logging.getLogger(__name__)

MANIFEST_VERSION = 1
MIN_PART_BYTES = 1024
MAX_PART_BYTES = 8 * 2**20  # parts of big tensors: one request's worth, checked before it is written
PARTS_PER_TENSOR = 4  # small tensors still come in a few parts, so that several peers share even a tiny model
MAX_MANIFEST_BYTES = 16 * 2**20  # a 70B model's manifest is about 1.5 MB
MAX_TENSORS = 100_000
MAX_TENSOR_BYTES = 2**40
MAX_DIMS = 8
MAX_SMALL_FILE_BYTES = 32 * 2**20  # LLaDA's tokenizer.json is 4 MB
MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header we read from a local file
ELEMENT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}  # safetensors dtypes a model's weights may have
# The small files a manifest may list: fixed names, so a name from the network is only ever one of these.
SMALL_FILES = tuple(dict.fromkeys((CONFIG_FILE, *(f for f in OPTIONAL_FILES if f != INDEX_FILE))))
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
TENSOR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,255}")
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
SHA256 = re.compile(r"[0-9a-f]{64}")


class ManifestError(SwarmError, ValueError):
    """A manifest that is malformed, over a bound, or disagrees with its own config."""

    exit_code = EXIT_USAGE


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def part_bytes_for(size: int) -> int:
    """The part size of a tensor of ``size`` bytes: about a quarter of it, a power of two between the bounds."""
    wanted = max(1, math.ceil(size / PARTS_PER_TENSOR))
    return min(MAX_PART_BYTES, max(MIN_PART_BYTES, 1 << (wanted - 1).bit_length()))


@dataclass(frozen=True)
class FileEntry:
    """A small file (config, tokenizer), fetched whole."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: what it is, where its bytes are in the publisher's file, and the hash of each part."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str  # the publisher's shard file (information only: never a path on the fetching side)
    offset: int  # first byte of the tensor in that file
    size: int
    sha256: str
    part_bytes: int
    parts: tuple[str, ...]

    def part(self, index: int) -> tuple[int, int]:
        """(offset within the tensor, length) of part ``index``."""
        start = index * self.part_bytes
        return start, min(self.part_bytes, self.size - start)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "file": self.file,
                "offset": self.offset, "size": self.size, "sha256": self.sha256, "part_bytes": self.part_bytes,
                "parts": list(self.parts)}


@dataclass(frozen=True)
class Manifest:
    """What a model is; :attr:`model_id` names it."""

    name: str  # the model's directory name: servers of a fetched copy announce under the same DHT prefix
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces): the same manifest always has the same bytes and id."""
        value = {"manifest_version": MANIFEST_VERSION, "name": self.name,
                 "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in self.files],
                 "tensors": [t.to_json() for t in self.tensors]}
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()

    @cached_property  # a frozen dataclass keeps it in its __dict__: hashed once per manifest
    def model_id(self) -> str:
        return sha256_hex(self.to_bytes())

    @property
    def weights_bytes(self) -> int:
        return sum(t.size for t in self.tensors)

    def tensor_index(self) -> dict[str, int]:
        return {t.name: i for i, t in enumerate(self.tensors)}

    def file(self, name: str) -> Optional[FileEntry]:
        return next((f for f in self.files if f.name == name), None)

    @classmethod
    def from_bytes(cls, data: bytes, model_id: Optional[str] = None) -> "Manifest":
        """Parse manifest bytes from anywhere, checking every field; with ``model_id``, the bytes must hash to it.

        :class:`ManifestError` says what is wrong; nothing else is raised."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"a manifest of {len(data)} bytes is over the limit of {MAX_MANIFEST_BYTES}")
        if model_id is not None and sha256_hex(data) != model_id:
            raise ManifestError(f"the manifest's bytes do not hash to the model id {model_id}")
        try:
            value = json.loads(data)
        except (UnicodeDecodeError, ValueError) as error:
            raise ManifestError(f"the manifest is not JSON ({str(error)[:100]})") from None
        try:
            manifest = _parse(value)
        except (KeyError, TypeError, ValueError) as error:
            raise ManifestError(f"malformed manifest: {str(error)[:300]}") from None
        if manifest.to_bytes() != data:  # one model, one id: a reordered or re-spaced copy is another id
            raise ManifestError("the manifest is not in canonical form (sorted keys, no spaces)")
        return manifest


def _parse(value: Any) -> Manifest:
    if not isinstance(value, dict) or value.get("manifest_version") != MANIFEST_VERSION:
        raise ValueError(f"unknown manifest version (this peer reads version {MANIFEST_VERSION})")
    if set(value) != {"manifest_version", "name", "files", "tensors"}:
        raise ValueError(f"unexpected fields {sorted(set(value) - {'manifest_version', 'name', 'files', 'tensors'})}")
    name = _matching(value["name"], MODEL_NAME, "model name")
    files_raw, tensors_raw = value["files"], value["tensors"]
    if not isinstance(files_raw, list) or len(files_raw) > len(SMALL_FILES):
        raise ValueError(f"files must be a list of at most {len(SMALL_FILES)}")
    files = tuple(_parse_file(f) for f in files_raw)
    if len({f.name for f in files}) != len(files) or CONFIG_FILE not in {f.name for f in files}:
        raise ValueError(f"files must name each file once and include {CONFIG_FILE}")
    if not isinstance(tensors_raw, list) or not 0 < len(tensors_raw) <= MAX_TENSORS:
        raise ValueError(f"tensors must be a list of 1 to {MAX_TENSORS}")
    tensors = tuple(_parse_tensor(t) for t in tensors_raw)
    if len({t.name for t in tensors}) != len(tensors):
        raise ValueError("a tensor is listed twice")
    return Manifest(name, files, tensors)


def _matching(raw: Any, pattern: re.Pattern, what: str) -> str:
    if not isinstance(raw, str) or not pattern.fullmatch(raw):
        raise ValueError(f"{what} {str(raw)[:80]!r} does not match {pattern.pattern}")
    return raw


def _count(raw: Any, low: int, high: int, what: str) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool) or not low <= raw <= high:
        raise ValueError(f"{what} must be an integer in [{low}, {high}], got {str(raw)[:40]}")
    return raw


def _fields(raw: Any, names: set[str], what: str) -> dict:
    if not isinstance(raw, dict) or set(raw) != names:
        raise ValueError(f"a {what} entry has the fields {sorted(names)}")
    return raw


def _parse_file(raw: Any) -> FileEntry:
    raw = _fields(raw, {"name", "size", "sha256"}, "file")
    if raw["name"] not in SMALL_FILES:
        raise ValueError(f"file {str(raw['name'])[:80]!r} is not one of the files a model may list")
    return FileEntry(raw["name"], _count(raw["size"], 0, MAX_SMALL_FILE_BYTES, "a file's size"),
                     _matching(raw["sha256"], SHA256, "sha256"))


def _parse_tensor(raw: Any) -> TensorEntry:
    raw = _fields(raw, {"name", "dtype", "shape", "file", "offset", "size", "sha256", "part_bytes", "parts"},
                  "tensor")
    name = _matching(raw["name"], TENSOR_NAME, "tensor name")
    if raw["dtype"] not in ELEMENT_BYTES:
        raise ValueError(f"tensor {name}: dtype {str(raw['dtype'])[:20]!r} is not one of {sorted(ELEMENT_BYTES)}")
    shape = raw["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise ValueError(f"tensor {name}: shape must be a list of at most {MAX_DIMS} sizes")
    shape = tuple(_count(d, 0, MAX_TENSOR_BYTES, "a dimension") for d in shape)
    size = _count(raw["size"], 0, MAX_TENSOR_BYTES, "a tensor's size")
    if size != math.prod(shape) * ELEMENT_BYTES[raw["dtype"]]:
        raise ValueError(f"tensor {name}: {size} bytes is not its shape {list(shape)} in {raw['dtype']}")
    part_bytes = _count(raw["part_bytes"], MIN_PART_BYTES, MAX_PART_BYTES, "part_bytes")
    parts = raw["parts"]
    if not isinstance(parts, list) or len(parts) != max(1, math.ceil(size / part_bytes)):
        raise ValueError(f"tensor {name}: {size} bytes in parts of {part_bytes} need "
                         f"{max(1, math.ceil(size / part_bytes))} part hashes")
    return TensorEntry(name, raw["dtype"], shape, _matching(raw["file"], FILE_NAME, "file name"),
                       _count(raw["offset"], 0, 2**50, "offset"), size, _matching(raw["sha256"], SHA256, "sha256"),
                       part_bytes, tuple(_matching(p, SHA256, "part sha256") for p in parts))


# ----- building one from a checkpoint directory -------------------------------------------------------------
def safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data, header entries) of a safetensors file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > MAX_HEADER_BYTES:
            raise ManifestError(f"{path}: a safetensors header of {length} bytes")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def weight_files(directory: Path) -> list[str]:
    """The safetensors files of a checkpoint directory (from its index, or the single file)."""
    index = directory / INDEX_FILE
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (directory / SINGLE_FILE).exists():
        return [SINGLE_FILE]
    raise ManifestError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}")


def hash_range(path: Path, offset: int, size: int, part_bytes: int) -> tuple[str, list[str]]:
    """SHA-256 of ``size`` bytes at ``offset``, and of each part of them."""
    whole, parts = hashlib.sha256(), []
    with open(path, "rb") as f:
        f.seek(offset)
        for start in range(0, max(size, 1), part_bytes):
            data = f.read(min(part_bytes, size - start))
            if len(data) != min(part_bytes, size - start):
                raise ManifestError(f"{path} ends inside a tensor")
            whole.update(data)
            parts.append(sha256_hex(data))
    return whole.hexdigest(), parts


def build_manifest(directory: str | Path, name: Optional[str] = None) -> Manifest:
    """The manifest of a checkpoint directory (native, LLaDA or Dream layout): reads and hashes every tensor."""
    directory = Path(directory)
    name = name or directory.resolve().name
    if not MODEL_NAME.fullmatch(name):
        raise ManifestError(f"model directory name {name!r}: 1-64 letters, digits, '_', '.' or '-' (rename it)")
    files = []
    for file_name in SMALL_FILES:
        path = directory / file_name
        if path.is_file():
            data = path.read_bytes()
            if len(data) > MAX_SMALL_FILE_BYTES:
                raise ManifestError(f"{path} is over {MAX_SMALL_FILE_BYTES} bytes")
            files.append(FileEntry(file_name, len(data), sha256_hex(data)))
    tensors = []
    for file_name in weight_files(directory):
        data_start, header = safetensors_header(directory / file_name)
        for tensor_name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            start, end = entry["data_offsets"]
            size = end - start
            part_bytes = part_bytes_for(size)
            digest, parts = hash_range(directory / file_name, data_start + start, size, part_bytes)
            tensors.append(TensorEntry(tensor_name, entry["dtype"], tuple(entry["shape"]), file_name,
                                       data_start + start, size, digest, part_bytes, tuple(parts)))
    manifest = Manifest(name, tuple(files), tuple(sorted(tensors, key=lambda t: _natural_key(t.name))))
    return Manifest.from_bytes(manifest.to_bytes())  # what peers will check, checked here first


def _natural_key(name: str) -> list:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split(".")]


# ----- the manifest against its own config ------------------------------------------------------------------
def expected_tensors(directory: Path) -> dict[str, tuple[int, ...]]:
    """Stored name -> shape of every tensor the model of ``directory``'s config reads (built on the meta
    device: nothing is allocated)."""
    fmt = detect_format(directory)
    config = fmt.load_config(directory)
    with torch.device("meta"):
        model = DiffusionTransformer(config)
    return {fmt.tensor_name(name): tuple(t.shape) for name, t in model.native_state_dict().items()}


def check_against_config(manifest: Manifest, directory: Path) -> None:
    """Refuse a manifest whose tensors are not the ones its config (in ``directory``) describes."""
    try:
        expected = expected_tensors(directory)
    except (ValueError, KeyError, TypeError) as error:
        raise ManifestError(f"the manifest's config cannot be read: {str(error)[:300]}") from None
    listed = {t.name: t for t in manifest.tensors}
    problems = []
    for name, shape in expected.items():
        entry = listed.get(name)
        if entry is None:
            problems.append(f"{name} is missing")
        elif entry.shape != shape:
            problems.append(f"{name} is {list(entry.shape)}, its config says {list(shape)}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ManifestError(f"the manifest disagrees with its config: {'; '.join(problems[:3])}{more}")


def tensor_parts(entry: TensorEntry) -> Iterator[tuple[int, int, int]]:
    """(part index, offset within the tensor, length) of each part."""
    for index in range(len(entry.parts)):
        yield (index, *entry.part(index))
