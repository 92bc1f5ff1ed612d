"""Clients' sampled calls handed to an auditor: evidence files in a directory it reads each round (issue 55).

A client saves its sample (``DistributedDiffusionLM.save_audit_sample(DIR)``: one ``*.evidence`` file per call, the
bytes of :class:`~swarm.wire.evidence.CallEvidence`) and hands the files over however it likes (a shared directory,
a copy); an auditor started with ``--evidence-dir DIR`` takes up to :data:`MAX_FILES_PER_ROUND` of them each round,
oldest first, recomputes each on its own blocks (:func:`swarm.client.proofs.verify_evidence`), fails a server whose
signed answer is proven wrong in the report it publishes (so clients trusting it avoid the server), keeps the proof
files (``DIR/proofs/``) for anyone to verify, and removes the rest. A file that is not evidence is removed unread
past its size bound, and costs the auditor nothing else.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

from swarm.client.receipts import SUFFIX
from swarm.wire.evidence import MAX_EVIDENCE_BYTES, CallEvidence

logger = logging.getLogger(__name__)

MAX_FILES_PER_ROUND = 64  # each costs the auditor one pass of the call's blocks
PROOFS = "proofs"


def take(directory: Path) -> Iterator[tuple[Path, CallEvidence]]:
    """The evidence files waiting in ``directory``, oldest first, at most :data:`MAX_FILES_PER_ROUND`, each parsed
    (a file that is not evidence is logged and removed)."""
    try:
        files = sorted((p for p in directory.glob(f"*{SUFFIX}") if p.is_file()), key=lambda p: p.stat().st_mtime)
    except OSError as error:
        logger.warning("cannot read the evidence directory %s: %s", directory, error)
        return
    for path in files[:MAX_FILES_PER_ROUND]:
        try:
            if path.stat().st_size > MAX_EVIDENCE_BYTES:
                raise ValueError(f"over {MAX_EVIDENCE_BYTES} bytes")
            evidence = CallEvidence.from_bytes(path.read_bytes())
        except (OSError, ValueError) as error:
            logger.warning("evidence file %s refused: %s", path.name, str(error)[:200])
            path.unlink(missing_ok=True)
            continue
        yield path, evidence


def keep_proof(path: Path) -> Path:
    """Move a proven lie's evidence to ``proofs/`` beside it (kept for anyone to verify)."""
    proofs = path.parent / PROOFS
    proofs.mkdir(exist_ok=True)
    return path.replace(proofs / path.name)
