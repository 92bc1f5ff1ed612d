"""Batch-invariant inference passes: a row's result does not depend on what else shares its call.

Why: oneDNN and MKL pick their GEMM kernel (blocking, split of the reduction over K, threads) from the
shapes of the call, so in bfloat16 (and float32, where a single row takes the GEMV path) one row of
``x @ W.T`` is not bitwise the row it becomes inside a bigger ``x``. Picard windows, draft-and-verify and
classifier-free guidance batch several states of one sequence; a server may batch other clients' rows. Their
tokens are only the sequential run's if each row's numbers are the same whatever its neighbours.

How (after Thinking Machines' batch-invariant kernels: one fixed reduction order per row, no split depending on
the batch), built from stock CPU kernels instead of new ones:

* every matrix product runs over the flattened rows in tiles of a fixed ``rows_per_tile`` rows, the last one
  padded with zeros: the kernel only ever sees one shape per weight, so it makes the same choices for every
  row wherever it sits (tests/test_invariance.py proves position independence inside a tile per dtype);
* attention runs per state: SDPA's flash kernel reduces each query row over its keys with products whose
  shapes are the state's own; a padded state runs only its real queries over its real keys, so the padding
  another state brought into the call changes nothing (padded queries get zeros);
* RMSNorm reduces each row in float32 on one thread (4096 elements are below torch's parallel grain), and every
  other op is elementwise.

Training (autograd enabled) keeps the plain calls: invariance is for inference, where tokens are compared.
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BatchInvariance:
    """``enabled``: tile every product (the exact path's default); ``rows_per_tile``: the one GEMM shape per weight.

    16 rows: on a CPU at LLaDA-8B's widths a bfloat16 product of 16 rows costs what one of 1 row does (the weights'
    reads dominate), so a sequential pass pays nothing and a batch pays only its last tile's padding."""

    enabled: bool = True
    rows_per_tile: int = 16


# SWARM_BATCH_INVARIANT=0 turns it off for a whole process (a server that only serves single-state calls, or to
# measure what it costs); the batching modes then lose their identity in half precision.
DEFAULT = BatchInvariance(enabled=os.environ.get("SWARM_BATCH_INVARIANT", "1") != "0")
_state = threading.local()


def current() -> BatchInvariance:
    return getattr(_state, "setting", DEFAULT)


@contextlib.contextmanager
def batch_invariance(setting: BatchInvariance) -> Iterator[None]:
    """Run the passes inside with ``setting`` (per thread: a server's compute threads each set their own)."""
    previous = current()
    _state.setting = setting
    try:
        yield
    finally:
        _state.setting = previous


def active() -> bool:
    return current().enabled and not torch.is_grad_enabled()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, batch-invariant when :func:`active`."""
    if not active():
        return F.linear(x, weight, bias)
    tile = current().rows_per_tile
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    padding = (-rows) % tile
    if padding:
        flat = torch.cat([flat, flat.new_zeros(padding, flat.shape[1])])
    out = torch.cat([F.linear(part, weight, bias) for part in flat.split(tile)])
    return out[:rows].reshape(*x.shape[:-1], weight.shape[0])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding: Optional[torch.Tensor],
              first_row: int = 0) -> torch.Tensor:
    """Bidirectional SDPA of (batch, heads, length, head_dim); ``key_padding`` (batch, keys) True for real keys;
    the queries are the positions ``first_row...`` of the keys (a partial pass over a cache)."""
    if not active():
        mask = None if key_padding is None else key_padding[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
    if key_padding is None:  # states of one length: each is reduced alone, at its own shape
        return torch.cat([F.scaled_dot_product_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], is_causal=False)
                          for i in range(q.shape[0])])
    # A padded state: only its real queries over its real keys, so the call's shapes are the state's own (the
    # kernel's products over a query block take another path for another block height). Padded queries get zeros.
    out = torch.zeros_like(q)
    for i in range(q.shape[0]):
        keys = key_padding[i]
        queries = keys[first_row:first_row + q.shape[2]]
        out[i, :, queries] = F.scaled_dot_product_attention(
            q[i:i + 1, :, queries], k[i:i + 1, :, keys], v[i:i + 1, :, keys], is_causal=False)[0]
    return out
