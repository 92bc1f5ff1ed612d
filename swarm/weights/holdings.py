"""What a server can serve of its model: the manifest, and where each held file and tensor is on its disk.

A server of a checkpoint directory holds every tensor: its manifest is built once (hashing every byte) and kept
under ``$HF_HOME/swarm/weights/built/`` while the files keep their sizes and times. A server whose model was
fetched from peers (:mod:`swarm.weights.cache`) holds the tensors it fetched, and more as it fetches them. A model
named by repo id holds only the shards it downloaded: it serves nothing.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from swarm.dht.validation import KeyPolicy
from swarm.weights.cache import ModelCache, cache_root
from swarm.weights.manifest import SHA256, SMALL_FILES, Manifest, ManifestError, build_manifest, weight_files
from swarm.weights.records import HostRecord, hosts_policy

logger = logging.getLogger(__name__)


@dataclass
class Holdings:
    """What this peer can serve of one model: the manifest, and where each held file and tensor is."""

    manifest: Manifest
    manifest_bytes: bytes
    files: dict[str, Path]
    tensors: dict[int, tuple[Path, int]]  # place in the manifest -> (file, offset of its first byte)
    cache: Optional[ModelCache] = None  # a copy fetched from peers: tensors fetched later are held too

    @property
    def model_id(self) -> str:
        return self.manifest.model_id

    def refresh(self) -> None:
        if self.cache is not None:
            self.tensors = self.cache.held(self.manifest)

    def host_record(self, peer_id: str, addresses: list[str]) -> HostRecord:
        whole = len(self.tensors) == len(self.manifest.tensors)
        return HostRecord(peer_id, tuple(addresses), len(self.manifest_bytes),
                          None if whole else frozenset(self.tensors))

    @classmethod
    def of_model(cls, path: Path) -> Optional["Holdings"]:
        """What a server of the model at ``path`` can serve: a copy fetched from peers (its manifest is known), or
        a checkpoint directory with every weight file present; None for anything else (a model named by repo id
        holds only the shards it fetched)."""
        path = path.resolve()
        if _fetched_copy(path):
            cache = ModelCache(path.parent.name)
            manifest = cache.load_manifest()
            if manifest is None:
                return None
            return cls(manifest, cache.manifest_path.read_bytes(), _small_files(path, manifest),
                       cache.held(manifest), cache)
        try:
            names = weight_files(path)
        except (ManifestError, OSError, ValueError):
            return None
        if not all((path / name).is_file() for name in names):
            logger.info("not serving the weights of %s: not every weight file is here", path)
            return None
        manifest = built_manifest(path, names)
        tensors = {i: (path / t.file, t.offset) for i, t in enumerate(manifest.tensors)}
        return cls(manifest, manifest.to_bytes(), _small_files(path, manifest), tensors)


def _small_files(directory: Path, manifest: Manifest) -> dict[str, Path]:
    return {entry.name: directory / entry.name for entry in manifest.files}


def _built_place(directory: Path, weight_names: list[str]) -> tuple[Path, list]:
    """Where a directory's manifest is kept, and the sizes and times of the files it was built from."""
    names = sorted({*weight_names, *(name for name in SMALL_FILES if (directory / name).is_file())})
    signature = [[name, (directory / name).stat().st_size, (directory / name).stat().st_mtime_ns] for name in names]
    return cache_root() / "built" / f"{hashlib.sha256(str(directory).encode()).hexdigest()}.json", signature


def kept_manifest(directory: Path, weight_names: list[str]) -> Optional[Manifest]:
    """The manifest built before for ``directory``, if its files have not changed since (no hashing)."""
    kept, signature = _built_place(directory, weight_names)
    try:
        saved = json.loads(kept.read_text())
        if saved["signature"] == signature:
            return Manifest.from_bytes(saved["manifest"].encode())
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def built_manifest(directory: Path, weight_names: list[str]) -> Manifest:
    """The manifest of a checkpoint directory, built once and kept while its files keep their sizes and times."""
    manifest = kept_manifest(directory, weight_names)
    if manifest is not None:
        return manifest
    kept, signature = _built_place(directory, weight_names)
    started = time.monotonic()
    manifest = build_manifest(directory)
    logger.info("built the manifest of %s in %.1f s: model id %s", directory, time.monotonic() - started,
                manifest.model_id)
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        temporary = kept.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"signature": signature, "manifest": manifest.to_bytes().decode()}))
        os.replace(temporary, kept)
    except OSError as error:
        logger.warning("cannot keep the manifest of %s in %s: %s", directory, kept, error)
    return manifest


def known_model_id(path: Path) -> Optional[str]:
    """The model id of the model at ``path`` if it is known without hashing (a fetched copy, or a directory whose
    manifest was built before); None otherwise."""
    path = path.resolve()
    if _fetched_copy(path):
        return path.parent.name
    try:
        manifest = kept_manifest(path, weight_files(path))
    except (ManifestError, OSError, ValueError):
        return None
    return manifest.model_id if manifest is not None else None


def hosts_policies(path: Path) -> list[KeyPolicy]:
    """The hosts key of the model at ``path``, for this peer's DHT storage to bound (when its id is known now)."""
    model_id = known_model_id(path)
    return [hosts_policy(model_id)] if model_id is not None else []


def _fetched_copy(path: Path) -> bool:
    return path.parent.parent == cache_root().resolve() and SHA256.fullmatch(path.parent.name) is not None
