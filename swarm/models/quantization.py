"""Weight-only int8 quantization of a block span, so a volunteer with less memory can host more blocks.

Each ``nn.Linear`` weight is stored as int8 with one float scale per output channel (symmetric, absmax / 127)
and dequantized on the fly in ``forward``; activations, norms and biases stay in the span's dtype. Weights
shrink to 1 byte per parameter, half of bfloat16. The error is measured, not assumed: tests/test_formats.py
and benchmarks/span_memory.py compare against the float32 span (figures in docs/MODELS.md).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from swarm.models import invariance
from swarm.models.modules import BlockSpan

logger = logging.getLogger(__name__)

INT8_MAX = 127
ROWS_PER_CHUNK = 1024  # float32 temporaries stay at 1024 x in_features instead of the whole matrix


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
        quantized = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
        scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
        for rows in range(0, weight.shape[0], ROWS_PER_CHUNK):
            rows_slice = slice(rows, rows + ROWS_PER_CHUNK)
            chunk = weight[rows_slice].float()
            chunk_scale = chunk.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
            quantized[rows_slice] = (chunk / chunk_scale[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
            scale[rows_slice] = chunk_scale
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(quantized, scale.to(weight.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x @ (q * s)^T == (x @ q^T) * s for a per-output-channel s: scale the (smaller) output instead.
        out = invariance.linear(x, self.weight_int8.to(x.dtype)) * self.scale.to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_span_int8(span: BlockSpan) -> BlockSpan:
    """Replace every ``nn.Linear`` of ``span`` by an :class:`Int8Linear`, in place; returns the span.

    Load the span in the checkpoint's dtype (bfloat16 for LLaDA and Dream): its tensors are then views of
    the memory-mapped shards, read page by page as each weight is quantized. The remaining small tensors
    (norms, biases) are copied out at the end so that no view keeps the shards mapped and resident.
    The span's ``state_dict`` then holds ``weight_int8``/``scale`` instead of ``weight``: it is for
    serving, not for saving as a checkpoint.
    """
    before = _tensor_bytes(span)
    for parent in list(span.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear.from_linear(child))
    with torch.no_grad():
        for param in span.parameters():
            param.data = param.data.clone()
    logger.info("span %d:%d quantized to int8: tensors %.1f MiB -> %.1f MiB",
                span.start, span.end, before / 2**20, _tensor_bytes(span) / 2**20)
    return span


def _tensor_bytes(span: nn.Module) -> int:
    tensors = list(span.parameters()) + list(span.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
