"""LLaDA's training objective: mask each token with probability t ~ U(eps, 1), score masked ones by 1/t.

The same two functions give the evaluation's likelihood bound (``swarm.eval``): the expectation over t of
the 1/t-weighted masked cross-entropy bounds the negative log-likelihood of the sequence from above.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

EPS = 1e-3


def mask_tokens(
    tokens: torch.Tensor, mask_id: int, generator: torch.Generator, t: Optional[torch.Tensor] = None,
    given: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (noisy tokens, masked positions, per-row t).

    ``given`` (bool, like ``tokens``) marks positions never masked: by default the BOS column; a task's
    prompt too (LLaDA's supervised objective). ``t`` (one rate per row) is drawn from U(eps, 1) unless
    given: evaluation passes stratified rates to lower the variance of its estimate.
    """
    batch, length = tokens.shape
    if t is None:
        t = (1 - EPS) * torch.rand(batch, generator=generator) + EPS
    masked = torch.rand(batch, length, generator=generator) < t[:, None]
    if given is None:
        masked[:, 0] = False
    else:
        masked &= ~given
    noisy = torch.where(masked, torch.full_like(tokens, mask_id), tokens)
    return noisy, masked, t


def masked_cross_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, masked: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """Per-position cross-entropy (nats) on masked positions weighted by 1/t; zero elsewhere."""
    per_token = F.cross_entropy(logits.transpose(1, 2).float(), tokens, reduction="none")
    return per_token * masked / t[:, None]


def diffusion_loss(logits: torch.Tensor, tokens: torch.Tensor, masked: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on masked positions weighted by 1/t, averaged over all tokens (an ELBO bound)."""
    return masked_cross_entropy(logits, tokens, masked, t).sum() / tokens.numel()
