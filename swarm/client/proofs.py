"""Recomputing evidence of a real call: a verdict anyone holding the blocks reaches alone (issue 55).

:func:`verify_evidence` checks that the evidence is the accused server's own signed statement (receipt signature,
peer id from the key, call and answer digests, the model, and for a reuse the fill the receipt names), then recomputes
the call on this process's copy of the blocks (:class:`~swarm.client.reference.LocalReference`, the server's pass
restated) and compares. Verdicts:

* ``lie``: the server signed an answer that the call does not give: a proof against ``accused``;
* ``honest``: the answer is right: whoever claimed otherwise is wrong, and nobody is punished;
* ``invalid``: not the accused's signed statement (forged, altered, another model, a fill it never used), or not a
  call of this model (blocks out of range, a head query that does not parse): nobody is punished;
* ``unprovable``: the receipt says the server computes with other numerics than the checkpoint's (another dtype,
  int8): its answers legitimately differ, so a difference proves nothing (clients use such servers only when they
  allow approximate numerics, and their own spot checks skip them likewise).

How close is right: a verifier rarely runs the server's device and kernels, so it cannot reproduce the last bits;
an answer is a lie when it differs from the recomputation by more than ``rtol`` (relative norm, the spot checks'
comparison: ``answers_agree``; predicted tokens exactly). A server that announces batch-invariant passes is held to
``rtol``; one that does not (its merged rows may change in the last bits with their batch-mates) to
``NON_INVARIANT_FACTOR x rtol``. A wrong-by-one-bit answer is thus never a proof: a liar can hide a perturbation
below ``rtol`` (1e-3 of the hidden states' norm at the default), and no more.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from swarm.client.reference import LocalReference
from swarm.client.spot_check import answers_agree, relative_difference
from swarm.diffusion.prediction import HeadQuery
from swarm.models.config import ModelConfig
from swarm.wire.evidence import CallEvidence, decoded

logger = logging.getLogger(__name__)

PROOF_RTOL = 1e-3  # the spot checks' default tolerance (ClientConfig.spot_check_rtol)
NON_INVARIANT_FACTOR = 10.0
MAX_TOKENS = 16384  # positions of one recomputed call (a server's default --max-batch-tokens)


class Verdict(str, enum.Enum):
    LIE = "lie"
    HONEST = "honest"
    INVALID = "invalid"
    UNPROVABLE = "unprovable"


@dataclass(frozen=True)
class Finding:
    verdict: Verdict
    accused: Optional[str]  # the server the evidence speaks about (None when it is not its signed statement)
    reason: str = ""
    difference: float = 0.0  # relative difference of the answer from the recomputation

    def to_dict(self) -> dict:
        return {"verdict": self.verdict.value, "accused": self.accused, "reason": self.reason,
                "difference": self.difference}


def verify_evidence(evidence: CallEvidence, reference: LocalReference, prefix: str, config: ModelConfig,
                    rtol: float = PROOF_RTOL) -> Finding:
    """The verdict on ``evidence`` for model ``prefix`` (``config``), recomputed on ``reference`` (module doc)."""
    problem = evidence.problem(prefix)
    if problem is not None:
        return Finding(Verdict.INVALID, None, problem)
    accused, receipt = evidence.accused, evidence.receipt
    if not receipt.exact:
        return Finding(Verdict.UNPROVABLE, accused, "the server announces other numerics than the checkpoint's")
    try:
        request = call_request(evidence, config)
        fill = decoded(evidence.fill.hidden) if evidence.fill is not None else None
        expected = reference.answer(request, fill)
        answer = decoded(evidence.answer)
    except Exception as error:  # remote input the model cannot take (shapes, an adapter's form): nobody accused
        return Finding(Verdict.INVALID, None, f"not a call of this model: {type(error).__name__}: {str(error)[:200]}")
    tolerance = rtol if receipt.invariant else rtol * NON_INVARIANT_FACTOR
    difference = relative_difference(answer, expected) if answer.shape == expected.shape else float("inf")
    if answers_agree(answer, expected, tolerance):
        return Finding(Verdict.HONEST, accused, "the recomputed answer agrees", difference)
    what = "predictions" if request.head is not None else "hidden states"
    return Finding(Verdict.LIE, accused, f"wrong {what} for blocks {request.start}:{request.end}: relative "
                   f"difference {difference:.3g} > {tolerance:g}", difference)


def call_request(evidence: CallEvidence, config: ModelConfig):
    """The evidence's call as a request of this model (ValueError when it cannot be one)."""
    if evidence.end > config.num_layers:
        raise ValueError(f"blocks {evidence.start}:{evidence.end} of a model of {config.num_layers}")
    batch, length, hidden_size = (int(n) for n in evidence.hidden.size)
    if hidden_size != config.hidden_size:
        raise ValueError(f"hidden states of width {hidden_size}, the model's are {config.hidden_size}")
    fill_length = int(evidence.fill.hidden.size[1]) if evidence.fill is not None else length
    if max(length, fill_length) > config.max_position_embeddings or batch * max(length, fill_length) > MAX_TOKENS:
        raise ValueError(f"a call of {batch} x {max(length, fill_length)} positions: at most "
                         f"{config.max_position_embeddings} positions and {MAX_TOKENS} in all are recomputed")
    head = None
    if evidence.head is not None:
        if evidence.end != config.num_layers:
            raise ValueError("a head query on a hop that does not end at the last block")
        first = evidence.cache.rows[0] if evidence.cache is not None and evidence.cache.rows else 0
        head = HeadQuery.parse(evidence.head, batch, length, config.vocab_size, first)
        if head.to_dict() != evidence.head:
            raise ValueError("the head query does not read back as sent")
    if evidence.adapter is not None and evidence.adapter.weights.shape[-1] != config.hidden_size:
        raise ValueError("an adapter of another width")
    with torch.inference_mode():
        return evidence.request(head)
