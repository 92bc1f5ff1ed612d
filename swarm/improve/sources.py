"""Where a trainer's examples come from: a JSONL file, a folder of JSONL files that grows, or a ``datasets`` name.

Each round the trainer takes a *snapshot*: every example the source holds now, written to one JSONL file, with the
sha256 of that file (the digest a published version names as the data it saw). The source is read whole each round,
bounded by :data:`~swarm.finetune.data.MAX_DATA_BYTES`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from swarm.finetune.data import MAX_DATA_BYTES
from swarm.utils.errors import SwarmError
from swarm.utils.extras import install_hint

logger = logging.getLogger(__name__)

DATASETS_PREFIX = "datasets:"  # --data datasets:NAME[:SPLIT] reads a `datasets` dataset (prompt / response columns)


class SourceError(SwarmError, ValueError):
    """A data source that cannot be read (missing, too big, not JSONL, no `datasets` package)."""


@dataclass(frozen=True)
class Snapshot:
    path: Path
    examples: int
    sha256: str


@dataclass(frozen=True)
class DataSource:
    """``spec``: a JSONL file, a folder (its ``*.jsonl`` files in name order) or ``datasets:NAME[:SPLIT]``."""

    spec: str

    def describe(self) -> str:
        return self.spec

    def lines(self) -> Iterator[str]:
        """Every non-empty line the source holds now (raw JSONL text; the trainer's parser checks each)."""
        if self.spec.startswith(DATASETS_PREFIX):
            yield from self._dataset_lines()
            return
        path = Path(self.spec)
        if path.is_dir():
            files = sorted(p for p in path.glob("*.jsonl") if p.is_file())
        elif path.is_file():
            files = [path]
        else:
            raise SourceError(f"--data {self.spec}: no such file or folder (or datasets:NAME)")
        total = 0
        for file in files:
            total += file.stat().st_size
            if total > MAX_DATA_BYTES:
                raise SourceError(f"--data {self.spec} holds over {MAX_DATA_BYTES} bytes")
            text = file.read_text(errors="replace")
            complete = text if text.endswith("\n") else text[:text.rfind("\n") + 1]  # a line being written waits
            yield from (line for line in complete.splitlines() if line.strip())

    def _dataset_lines(self) -> Iterator[str]:
        name, _, split = self.spec[len(DATASETS_PREFIX):].partition(":")
        if importlib.util.find_spec("datasets") is None:
            raise SourceError(f"--data {self.spec}: the `datasets` package is not installed: {install_hint('data')}")
        import datasets  # optional: only for this kind of source

        table = datasets.load_dataset(name, split=split or "train")
        missing = {"prompt", "response"} - set(table.column_names)
        if missing:
            raise SourceError(f"--data {self.spec}: the dataset has no column {', '.join(sorted(missing))}")
        total = 0
        for row in table:
            line = json.dumps({"prompt": row["prompt"], "response": row["response"]})
            total += len(line)
            if total > MAX_DATA_BYTES:
                raise SourceError(f"--data {self.spec} holds over {MAX_DATA_BYTES} bytes")
            yield line

    def snapshot(self, target: Path) -> Snapshot:
        """Write what the source holds now to ``target`` (replaced whole) and digest it."""
        digest, count = hashlib.sha256(), 0
        temporary = target.with_name(target.name + ".tmp")
        with temporary.open("w") as out:
            for line in self.lines():
                line = line.strip() + "\n"
                out.write(line)
                digest.update(line.encode())
                count += 1
        os.replace(temporary, target)
        return Snapshot(target, count, digest.hexdigest())
