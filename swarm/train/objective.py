"""LLaDA's training objective: mask each token with probability t ~ U(eps, 1), score masked ones by 1/t."""
from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-3


def mask_tokens(tokens: torch.Tensor, mask_id: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (noisy tokens, masked positions, per-row t). The BOS column is never masked."""
    batch, length = tokens.shape
    t = (1 - EPS) * torch.rand(batch, generator=generator) + EPS
    masked = torch.rand(batch, length, generator=generator) < t[:, None]
    masked[:, 0] = False
    noisy = torch.where(masked, torch.full_like(tokens, mask_id), tokens)
    return noisy, masked, t


def diffusion_loss(logits: torch.Tensor, tokens: torch.Tensor, masked: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on masked positions weighted by 1/t, averaged over all tokens (an ELBO bound)."""
    per_token = F.cross_entropy(logits.transpose(1, 2).float(), tokens, reduction="none")
    weighted = per_token * masked / t[:, None]
    return weighted.sum() / tokens.numel()
