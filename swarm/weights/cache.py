"""A model fetched from the swarm, on disk: only checked bytes, under names this peer chose.

Layout, under ``$HF_HOME/swarm/weights/{model id}/``::

    manifest.json              the manifest (its SHA-256 is the directory's name); written last, once installed
    {name}/config.json ...     the small files the manifest lists (their names are from a fixed list)
    {name}/model.safetensors.index.json   every tensor -> t-NNNNN.safetensors (NNNNN: its place in the manifest)
    {name}/t-NNNNN.safetensors one file per fetched tensor, appearing only when every byte of it is checked
    partial/t-NNNNN.safetensors  a tensor being fetched: a part is written only once its hash is checked

and ``$HF_HOME/swarm/weights/.locks/{model id}``, the lock one process at a time holds to install or fetch.

The directory ``{name}`` is the model's name (its DHT prefix, as for a copy of the publisher's directory), and
:class:`swarm.models.checkpoint.CheckpointReader` reads it like any sharded checkpoint: a span opens only its
own tensors' files, and asks (``fetch``) for the ones not there yet. After a crash, the parts in ``partial/``
are hashed again and those that match are kept.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from huggingface_hub import constants

from swarm.models.checkpoint import INDEX_FILE
from swarm.weights.manifest import Manifest, ManifestError, TensorEntry, check_against_config, sha256_hex

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
TENSOR_FILE = re.compile(r"t-(\d{5,6})\.safetensors")


def cache_root() -> Path:
    """Where fetched models live: beside the Hugging Face cache (``HF_HOME``)."""
    return Path(constants.HF_HOME) / "swarm" / "weights"


def tensor_file(index: int) -> str:
    return f"t-{index:05d}.safetensors"


def tensor_header(entry: TensorEntry) -> bytes:
    """The safetensors header of a file holding ``entry`` alone (length prefix included, padded to 8 bytes)."""
    header = json.dumps({entry.name: {"dtype": entry.dtype, "shape": list(entry.shape),
                                      "data_offsets": [0, entry.size]}, "__metadata__": {"format": "pt"}},
                        separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header


class PartialTensor:
    """One tensor being fetched: its file exists at full size, and holds only parts whose hash was checked."""

    def __init__(self, path: Path, entry: TensorEntry):
        self.path, self.entry = path, entry
        self.header = tensor_header(entry)
        self.verified: set[int] = set()
        path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not path.exists() or path.stat().st_size != len(self.header) + entry.size
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._prepare(fresh)
        except BaseException:
            os.close(self.fd)
            raise

    def _prepare(self, fresh: bool) -> None:
        """Write the header and size of a fresh file, or find the parts of a resumed one that still hash right."""
        entry = self.entry
        if fresh or os.pread(self.fd, len(self.header), 0) != self.header:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, self.header, 0)
            os.ftruncate(self.fd, len(self.header) + entry.size)
        else:  # resumed: keep the parts that still hash right
            for index in range(len(entry.parts)):
                start, length = entry.part(index)
                if sha256_hex(os.pread(self.fd, length, len(self.header) + start)) == entry.parts[index]:
                    self.verified.add(index)
            if self.verified:
                logger.info("resuming %s: %d of %d parts already checked", entry.name, len(self.verified),
                            len(entry.parts))

    @property
    def missing(self) -> list[int]:
        return [i for i in range(len(self.entry.parts)) if i not in self.verified]

    def write(self, index: int, data: bytes) -> None:
        """Write part ``index``: the caller has checked its hash against the manifest."""
        start, length = self.entry.part(index)
        if len(data) != length:
            raise ValueError(f"part {index} of {self.entry.name} is {length} bytes, not {len(data)}")
        os.pwrite(self.fd, data, len(self.header) + start)
        self.verified.add(index)

    def finish(self, target: Path) -> None:
        """Check the whole tensor's hash, then move the file into the model directory."""
        os.fsync(self.fd)
        data = os.pread(self.fd, self.entry.size, len(self.header))
        os.close(self.fd)
        if sha256_hex(data) != self.entry.sha256:  # its parts all matched: the manifest contradicts itself
            self.path.unlink(missing_ok=True)
            raise ManifestError(f"tensor {self.entry.name}: its parts match the manifest but the whole does not")
        os.replace(self.path, target)

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class ModelCache:
    """The on-disk copy of one model id (see the module docstring)."""

    def __init__(self, model_id: str, root: Optional[Path] = None):
        self.model_id = model_id
        self.directory = (root or cache_root()) / model_id

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold this model's lock (a file in ``.locks/`` beside its directory): two processes on one machine (two
        servers, a server and ``swarm.weights fetch``) install and fetch one after the other, never into the same
        partial file."""
        locks = self.directory.parent / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / self.model_id, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @property
    def manifest_path(self) -> Path:
        return self.directory / MANIFEST_FILE

    def model_dir(self, manifest: Manifest) -> Path:
        return self.directory / manifest.name

    def load_manifest(self) -> Optional[Manifest]:
        """The installed manifest, if it is there and still hashes to the id (anything else: None)."""
        try:
            return Manifest.from_bytes(self.manifest_path.read_bytes(), self.model_id)
        except (OSError, ManifestError) as error:
            if self.manifest_path.exists():
                logger.warning("ignoring the cached manifest of %s: %s", self.model_id, error)
            return None

    def install(self, manifest_bytes: bytes, manifest: Manifest, files: dict[str, bytes]) -> Path:
        """Write the small files and the tensor index, after checking the config against the manifest; on any
        failure nothing stays. ``files`` are checked against the manifest by the caller."""
        self.directory.mkdir(parents=True, exist_ok=True)
        staging = self.directory / f".staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging.mkdir()
            for entry in manifest.files:  # names from the manifest's fixed list only
                (staging / entry.name).write_bytes(files[entry.name])
            weight_map = {t.name: tensor_file(i) for i, t in enumerate(manifest.tensors)}
            (staging / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": manifest.weights_bytes},
                                                          "weight_map": weight_map}))
            check_against_config(manifest, staging)
            target = self.model_dir(manifest)
            for path in target.glob("t-*.safetensors") if target.exists() else ():
                os.replace(path, staging / path.name)  # tensors fetched before a crash are kept
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
            temporary = self.manifest_path.with_suffix(".tmp")
            temporary.write_bytes(manifest_bytes)
            os.replace(temporary, self.manifest_path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            if not self.manifest_path.exists():
                shutil.rmtree(self.directory, ignore_errors=True)
            raise
        return target

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def tensor_path(self, manifest: Manifest, index: int) -> Path:
        return self.model_dir(manifest) / tensor_file(index)

    def partial(self, manifest: Manifest, index: int) -> PartialTensor:
        return PartialTensor(self.directory / "partial" / tensor_file(index), manifest.tensors[index])

    def held(self, manifest: Manifest) -> dict[int, tuple[Path, int]]:
        """Tensors present in full: index -> (file, offset of the tensor's bytes in it)."""
        held = {}
        for index, entry in enumerate(manifest.tensors):
            path = self.tensor_path(manifest, index)
            if path.exists():
                held[index] = (path, len(tensor_header(entry)))
        return held


def tensor_indices(file_names: list[str], count: int) -> list[int]:
    """The tensor places named by this cache's own file names (anything else is refused)."""
    indices = []
    for name in file_names:
        match = TENSOR_FILE.fullmatch(name)
        if match is None or int(match.group(1)) >= count:
            raise FileNotFoundError(f"{name} is not a tensor file of this model")
        indices.append(int(match.group(1)))
    return indices
