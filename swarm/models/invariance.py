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
from typing import Any, Callable, Iterator, Optional

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


def turn_off() -> None:
    """Invariance off for this whole process, every thread (a server's ``--no-batch-invariant``)."""
    global DEFAULT
    DEFAULT = BatchInvariance(enabled=False)


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


# ----- whether it holds here -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceInvariance:
    """Whether this process's passes are batch-invariant, so that batching states (Picard windows, drafts, cfg) or
    other clients' rows changes no token; ``why`` says how that was found (results and server records carry it)."""

    exact: bool
    why: str

    def to_json(self) -> dict[str, Any]:
        return {"batch_invariant": self.exact, "why": self.why}


Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_checked: dict[tuple, Optional[str]] = {}  # (shape, dtype, device, tile, product) -> why it failed, None if it held
_checked_lock = threading.Lock()


def tile_failure(weight: torch.Tensor, product: Product = F.linear) -> Optional[str]:
    """Why a row of a tile's product with ``weight`` is not the same number at every place of the tile (with other
    rows around it, or zeros as in a padded last tile), on the weight's device and dtype; None when it is.

    The tiles make every product one shape per weight, so the kernel's choices are the same for every call; what
    remains to hold is that a row's result does not depend on its place in the tile or on its neighbours. That is a
    property of the device's kernel, checked here with the weight itself (kernels choose by shape and dtype)."""
    rows = current().rows_per_tile
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, weight.shape[1], generator=generator).to(device=weight.device, dtype=weight.dtype)
    which = f"a {weight.dtype} product with a {tuple(weight.shape)} weight on {weight.device} gives a row"
    with torch.inference_mode():
        alone = product(x, weight)
        for shift in (1, rows // 2 + 1):
            if not torch.equal(product(x.roll(shift, 0), weight).roll(-shift, 0), alone):
                return f"{which} other numbers at another place of its tile"
        padded = torch.zeros_like(x)
        padded[0] = x[0]
        if not torch.equal(product(padded, weight)[0], alone[0]):
            return f"{which} other numbers beside padding than beside other rows"
    return None


def product_weights(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """One weight of each shape, dtype and device among the module's products (``nn.Linear`` and int8 layers, whose
    weight is converted to the activations' dtype before the product)."""
    seen: set[tuple] = set()
    for child in module.modules():
        if isinstance(child, torch.nn.Linear):
            weight = child.weight
            dtype = weight.dtype
        elif hasattr(child, "weight_int8") and hasattr(child, "scale"):
            weight, dtype = child.weight_int8, child.scale.dtype
        else:
            continue
        key = (tuple(weight.shape), dtype, weight.device)
        if key not in seen:
            seen.add(key)
            yield weight.detach() if weight.dtype == dtype else weight.detach().to(dtype)


def check_module(module: Optional[torch.nn.Module], product: Product = F.linear) -> DeviceInvariance:
    """Whether ``module``'s passes are batch-invariant on its device: the setting is on and every product shape
    holds :func:`tile_failure`'s property (checked once per shape, dtype and device in a process). Attention (per
    state, at the state's own shape) and the norms (per row) hold by construction."""
    if not current().enabled:
        return DeviceInvariance(False, "batch invariance is off in this process (SWARM_BATCH_INVARIANT=0): a row "
                                       "may change with what shares its call")
    checked: list[str] = []
    for weight in (product_weights(module) if module is not None else ()):
        key = (tuple(weight.shape), weight.dtype, str(weight.device), current().rows_per_tile, product)
        with _checked_lock:
            if key not in _checked:
                _checked[key] = tile_failure(weight, product)
            failure = _checked[key]
        if failure is not None:
            return DeviceInvariance(False, failure)
        checked.append(f"{weight.dtype}".replace("torch.", "") + f" on {weight.device}")
    where = ", ".join(sorted(set(checked))) or "no product"
    return DeviceInvariance(True, f"every product runs in tiles of {current().rows_per_tile} rows, each row checked "
                                  f"to be the same at every place of its tile ({where}); attention runs per state")
