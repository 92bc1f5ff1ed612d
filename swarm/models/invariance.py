"""Batch-invariant inference passes: a row's result does not depend on what else shares its call.

Why: oneDNN and MKL pick their GEMM kernel (blocking, split of the reduction over K, threads) from the
shapes of the call, so one row of ``x @ W.T`` is not always bitwise the row it becomes inside a bigger ``x``: a
single row takes a GEMV path, a few rows of float32 another one (2, 3 and 5 rows differ on this CPU), and a device
that splits the reduction over K for small products changes a row's numbers with the row count. Picard windows,
draft-and-verify and classifier-free guidance batch several states of one sequence; a server may batch other
clients' rows. Their tokens are only the sequential run's if each row's numbers are the same whatever its
neighbours.

How (after Thinking Machines' batch-invariant kernels: one fixed reduction order per row, no split depending on
the batch), built from stock kernels instead of new ones, at the cost of nothing for one state:

* every matrix product runs untiled over the flattened rows when their count lies in a checked range
  ``[min_rows, max_rows]`` (16-512 by default): fewer rows are padded with zeros up to ``min_rows`` (the shapes
  where kernels take another path), more are split into products of ``max_rows``. So each product reads its
  weight once, as the plain call does, and the only property needed of the kernel is that a row's numbers do
  not depend on the row count inside that range, nor on the row's place or its neighbours. That is a property of
  the device's kernel, so it is checked at start on the weights themselves (:func:`check_module`), never assumed;
  where it fails the process says so and nothing batches states or clients' rows;
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
    """``enabled``: keep every product's row count inside ``[min_rows, max_rows]`` (the exact path's default).

    16 rows at least: below that kernels switch paths (GEMV for one row), and on a CPU at LLaDA-8B's widths a
    bfloat16 product of 16 rows costs what one of 1 row does (the weights' reads dominate), so padding a short
    product costs nothing. 512 at most: the longest state users send in one product, and the range the start-up
    check samples; a longer product is split into products of 512 rows, each reading the weights once more (at
    512 rows a product is bound by arithmetic, so that costs little)."""

    enabled: bool = True
    min_rows: int = 16
    max_rows: int = 512

    def __post_init__(self) -> None:
        if not 1 <= self.min_rows <= self.max_rows:
            raise ValueError(f"batch invariance needs 1 <= min_rows <= max_rows, got {self.min_rows}, {self.max_rows}")


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


def prepare_cuda() -> None:
    """Turn off, for this process, what torch lets us turn off of the CUDA matmuls' dependence on their shapes:
    reduced-precision reductions in cuBLAS (a half-precision product may accumulate partly in half precision,
    split by shape) and TF32 for float32. Split-K, which cuBLAS may choose for products of few rows, is not
    settable from here: :func:`check_module` at start judges whether the kernels hold (and a server announces
    what it found). ``benchmarks/gpu_check.sh`` measures both on a GPU."""
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def active() -> bool:
    return current().enabled and not torch.is_grad_enabled()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, batch-invariant when :func:`active`: the plain call whenever the row count is
    inside the checked range (one state of 16-512 positions: no cost at all), else padded or split into it."""
    setting = current()
    if not active():
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if setting.min_rows <= rows <= setting.max_rows:  # the checked range: one product, as the plain call makes
        return F.linear(flat, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    parts = []
    for part in flat.split(setting.max_rows):
        short = setting.min_rows - part.shape[0]
        padded = torch.cat([part, part.new_zeros(short, part.shape[1])]) if short > 0 else part
        parts.append(F.linear(padded, weight, bias)[:part.shape[0]])
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding: Optional[torch.Tensor],
              first_row: int = 0) -> torch.Tensor:
    """Bidirectional SDPA of (batch, heads, length, head_dim); ``key_padding`` (batch, keys) True for real keys;
    the queries are the positions ``first_row...`` of the keys (a partial pass over a cache)."""
    if not active():
        mask = None if key_padding is None else key_padding[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
    if key_padding is None and q.shape[0] == 1:  # one state: the plain call, no copy
        return F.scaled_dot_product_attention(q, k, v, is_causal=False)
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
_checked: dict[tuple, Optional[str]] = {}  # (shape, dtype, device, setting, product) -> why it failed, None if it held
_checked_lock = threading.Lock()


def sampled_row_counts(setting: BatchInvariance) -> list[int]:
    """Row counts inside ``[min_rows, max_rows)`` that the check compares with ``max_rows``: the lowest and its
    neighbour, and the counts beside powers of four (where kernels change their blocking): on the default setting
    353 rows, so a check costs less than two products of ``max_rows`` rows per weight shape."""
    low, high = setting.min_rows, setting.max_rows
    counts = {low, low + 1}
    power = 2
    while power < high:
        counts.update((power - 1, power + 1))
        power *= 4
    return sorted(count for count in counts if low <= count < high)


def row_count_failure(weight: torch.Tensor, product: Product = F.linear) -> Optional[str]:
    """Why a row of a product with ``weight`` is not the same number whatever the product's row count inside the
    checked range, its place among the rows and its neighbours (other rows, or the zeros that pad a short product),
    on the weight's device and dtype; None when it is.

    :func:`linear` runs every product with a row count inside ``[min_rows, max_rows]``, so that is what must hold
    for a state's numbers not to depend on what shares its call. It is a property of the device's kernel (kernels
    choose blocking, threads and reduction splits by shape and dtype), checked here with the weight itself: the
    shortest product rolled and beside padding, then a product of ``max_rows`` rows against products of the sampled
    counts at several offsets."""
    setting = current()
    high = setting.max_rows
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(high, weight.shape[1], generator=generator).to(device=weight.device, dtype=weight.dtype)
    which = f"a {weight.dtype} product with a {tuple(weight.shape)} weight on {weight.device} gives a row"
    low = setting.min_rows
    with torch.inference_mode():
        shortest = product(x[:low], weight)
        if not torch.equal(product(x[:low].roll(1, 0), weight).roll(-1, 0), shortest):
            return f"{which} other numbers at another place among the same rows"
        padded = torch.zeros_like(x[:low])
        padded[0] = x[0]
        if not torch.equal(product(padded, weight)[0], shortest[0]):
            return f"{which} other numbers beside padding than beside other rows"
        reference = product(x, weight)
        for place, count in enumerate(sampled_row_counts(setting)):
            start = (place * 7) % (high - count + 1)
            if not torch.equal(product(x[start:start + count], weight), reference[start:start + count]):
                return f"{which} other numbers in a product of {count} rows than in one of {high}"
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
    holds :func:`row_count_failure`'s property (checked once per shape, dtype and device in a process). Attention (per
    state, at the state's own shape) and the norms (per row) hold by construction."""
    if not current().enabled:
        return DeviceInvariance(False, "batch invariance is off in this process (SWARM_BATCH_INVARIANT=0): a row "
                                       "may change with what shares its call")
    checked: list[str] = []
    for weight in (product_weights(module) if module is not None else ()):
        key = (tuple(weight.shape), weight.dtype, str(weight.device), current(), product)
        with _checked_lock:
            if key not in _checked:
                _checked[key] = row_count_failure(weight, product)
            failure = _checked[key]
        if failure is not None:
            return DeviceInvariance(False, failure)
        checked.append(f"{weight.dtype}".replace("torch.", "") + f" on {weight.device}")
    where = ", ".join(sorted(set(checked))) or "no product"
    setting = current()
    return DeviceInvariance(True, f"every product runs {setting.min_rows}-{setting.max_rows} rows at a time, a row "
                                  f"checked to be the same at every row count, place and beside padding ({where}); "
                                  "attention runs per state")
