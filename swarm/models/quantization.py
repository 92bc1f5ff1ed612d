"""Weight-only int8 quantization of a block span, so a volunteer with less memory can host more blocks.

Each ``nn.Linear`` weight is stored as int8 with one float scale per output channel (symmetric, absmax / 127)
and dequantized on the fly in ``forward``; activations, norms and biases stay in the span's dtype. The
weights shrink to 1 byte per parameter, about half of bfloat16 and a quarter of float32, at a relative
error of the block output that tests measure (about 1e-2).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from swarm.models.modules import BlockSpan

logger = logging.getLogger(__name__)

INT8_MAX = 127


class Int8Linear(nn.Module):
    """A frozen linear layer whose weight is int8 with a per-output-channel scale."""

    def __init__(self, weight_int8: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scale", scale)  # (out_features,), in the original weight's dtype
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        weight = linear.weight.detach()
        absmax = weight.abs().amax(dim=1).float().clamp(min=torch.finfo(torch.float32).tiny)
        scale = absmax / INT8_MAX
        quantized = torch.round(weight.float() / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(quantized, scale.to(weight.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x @ (q * s)^T == (x @ q^T) * s for a per-output-channel s: scale the (smaller) output instead.
        out = F.linear(x, self.weight_int8.to(x.dtype)) * self.scale.to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_span_int8(span: BlockSpan) -> BlockSpan:
    """Replace every ``nn.Linear`` of ``span`` by an :class:`Int8Linear`, in place; returns the span.

    Load the span in bfloat16 (or float16) first: each float weight is freed as soon as its int8 copy
    exists, so the peak is the half-precision span, not float32. The span's ``state_dict`` then holds
    ``weight_int8``/``scale`` instead of ``weight``: it is for serving, not for saving as a checkpoint.
    """
    before = _weight_bytes(span)
    for parent in list(span.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear.from_linear(child))
    logger.info("span %d:%d quantized to int8: linear weights %.1f MiB -> %.1f MiB",
                span.start, span.end, before / 2**20, _weight_bytes(span) / 2**20)
    return span


def _weight_bytes(span: nn.Module) -> int:
    tensors = list(span.parameters()) + list(span.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
