"""One bidirectional transformer block (LLaMA layout) and its parts.

RMSNorm, rotary position embeddings, grouped-query attention with optional q/k/v bias, SwiGLU.
There is no causal mask: every position attends to every non-padding position, as masked diffusion needs.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from swarm.models import invariance
from swarm.models.config import ModelConfig
from swarm.models.kv_cache import BlockKV

# A low-rank correction of a block's projections, by projection name: (down (r, in), up (out, r)). An adapter
# (swarm/adapters/lora.py) unpacks it from its per-block tensor; the block only applies it.
BlockLoRA = dict[str, tuple[torch.Tensor, torch.Tensor]]


def project(linear: nn.Module, x: torch.Tensor, lora: Optional[BlockLoRA], name: str) -> torch.Tensor:
    """``linear(x)``, plus the LoRA correction of projection ``name`` when there is one (float32, then x's dtype);
    every product batch-invariant (:mod:`swarm.models.invariance`)."""
    out = invariance.linear(x, linear.weight, linear.bias) if isinstance(linear, nn.Linear) else linear(x)
    if lora is None:
        return out
    return out + low_rank(x, lora[name]).to(out.dtype)


def low_rank(x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``(x @ down.T) @ up.T`` in float32, batch-invariant: an adapter's correction of a projection."""
    down, up = factors
    return invariance.linear(invariance.linear(x.float(), down.float()), up.float())


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 so that half-precision weights do not lose the variance.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for positions of shape (batch, length) -> (batch, 1, length, head_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq  # (batch, length, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query self-attention without a causal mask."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        d, hd = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(d, config.num_heads * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, config.num_kv_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, config.num_kv_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * hd, d, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_padding: Optional[torch.Tensor],
        kv: Optional[BlockKV] = None, rows: Optional[tuple[int, int]] = None, lora: Optional[BlockLoRA] = None,
    ) -> torch.Tensor:
        """``x`` holds rows ``rows`` of the sequence (all of it when None); ``kv`` remembers or supplies the rest;
        ``lora`` corrects the projections (:func:`project`)."""
        batch, length, _ = x.shape
        cfg = self.config
        q, k, v = (project(linear, x, lora, name).view(batch, length, heads, cfg.head_dim).transpose(1, 2)
                   for linear, name, heads in ((self.q_proj, "q_proj", cfg.num_heads),
                                               (self.k_proj, "k_proj", cfg.num_kv_heads),
                                               (self.v_proj, "v_proj", cfg.num_kv_heads)))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv is not None:
            k, v = kv.merge(k, v, rows)
        groups = cfg.num_heads // cfg.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = invariance.attention(q, k, v, key_padding, rows[0] if rows is not None else 0)
        return project(self.o_proj, out.transpose(1, 2).reshape(batch, length, -1), lora, "o_proj")


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: Optional[BlockLoRA] = None) -> torch.Tensor:
        gated = F.silu(project(self.gate_proj, x, lora, "gate_proj")) * project(self.up_proj, x, lora, "up_proj")
        return project(self.down_proj, gated, lora, "down_proj")


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_padding: Optional[torch.Tensor] = None,
        kv: Optional[BlockKV] = None, rows: Optional[tuple[int, int]] = None, lora: Optional[BlockLoRA] = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, key_padding, kv, rows, lora)
        return x + self.mlp(self.mlp_norm(x), lora)
