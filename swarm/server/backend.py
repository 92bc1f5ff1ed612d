"""The compute side of a server: a loaded span, run on a worker thread, with bounded and fair admission."""
from __future__ import annotations

import asyncio
import ctypes
import logging
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, TypeVar

import torch

from swarm.diffusion.prediction import HeadQuery, predict_states
from swarm.models.kv_cache import SpanKV
from swarm.models.modules import DEEP_PROMPT, BlockSpan, OutputHead
from swarm.protocol import ErrorCode, RemoteError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class HeapTrimmer:
    """Gives the heap's free memory back to the system a moment after the last admission that computes
    has emptied (or one that holds finished outputs, such as pushes, empties while none computes).

    glibc keeps freed memory for reuse, and after the first large block is freed it stops mapping large
    blocks on their own, so a server that once held a large request or a flood of pushes would keep that
    memory for good (benchmarks/server_bounds.py, a push flood on a server of 300 MiB: 646 MiB stayed
    without trimming, 320-360 MiB with it). A trim costs about 30 ms after heavy work and nothing when there
    is little to give back; a fixed mapping threshold instead (``MALLOC_MMAP_THRESHOLD_``) made compute
    1.6x slower.
    """

    DELAY_S = 1.0

    def __init__(self) -> None:
        self.libc = _glibc()
        self.active: weakref.WeakSet[Admission] = weakref.WeakSet()  # the admissions holding something
        self.scheduled = False

    def busy(self, admission: "Admission") -> None:
        if admission.computes:
            self.active.add(admission)

    def idle(self, admission: "Admission") -> None:
        self.active.discard(admission)
        if self.libc is None or self.scheduled or self.active:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # released outside a loop (a test, a shutdown): nothing to schedule on
            return
        self.scheduled = True
        loop.call_later(self.DELAY_S, self._trim)

    def _trim(self) -> None:
        self.scheduled = False
        if not self.active:
            self.libc.malloc_trim(0)


def _glibc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc: its allocator has its own policy
        return None


TRIMMER = HeapTrimmer()


class Admission:
    """Counts what peers hold (a number of items and an amount: tokens or bytes), in total and per peer.

    Beyond ``max_count`` items or ``max_amount`` in total, or beyond ``peer_share`` of either for one peer,
    a request is refused as busy instead of waiting: a bound on what may wait is what keeps a server's
    memory and latency in check, and the per-peer share keeps one client from taking every slot. The
    first item of an empty queue (or of a peer holding nothing) is admitted whatever its amount, so a
    request that passed the size checks can always run on an idle server. ``computes``: what it admits
    allocates as it runs (the heap is trimmed only while no such admission holds anything).
    """

    def __init__(self, what: str, max_count: int, max_amount: Optional[int] = None, unit: str = "tokens",
                 peer_share: float = 1.0, computes: bool = True):
        if not 0 < peer_share <= 1:
            raise ValueError(f"peer_share must be in (0, 1], got {peer_share}")
        self.what, self.unit, self.computes = what, unit, computes
        self.max_count, self.max_amount, self.peer_share = max_count, max_amount, peer_share
        self.count = self.amount = 0
        self.peer_counts: Counter[str] = Counter()
        self.peer_amounts: Counter[str] = Counter()
        self.refused = 0

    @property
    def peer_max_count(self) -> int:
        return max(1, int(self.max_count * self.peer_share))

    def acquire(self, peer: str, amount: int) -> "Grant":
        """Hold ``amount`` for ``peer`` until the grant is released; :class:`RemoteError` (busy) if over a bound."""
        reason = self._over_bound(peer, amount)
        if reason is not None:
            self.refused += 1
            raise RemoteError(ErrorCode.BUSY, f"server busy: {reason}")
        self.count += 1
        self.amount += amount
        self.peer_counts[peer] += 1
        self.peer_amounts[peer] += amount
        TRIMMER.busy(self)
        return Grant(self, peer, amount)

    def _over_bound(self, peer: str, amount: int) -> Optional[str]:
        if self.count >= self.max_count:
            return f"{self.count} {self.what} in flight, the most it takes"
        if self.max_amount is not None and self.count and self.amount + amount > self.max_amount:
            return f"{self.amount} {self.unit} of {self.what} queued, {amount} more would pass {self.max_amount}"
        held, held_amount = self.peer_counts[peer], self.peer_amounts[peer]
        if held >= self.peer_max_count:
            return f"this peer holds {held} {self.what}, its share of the {self.max_count} it takes"
        share = int(self.peer_share * self.max_amount) if self.max_amount is not None else None
        if share is not None and held and held_amount + amount > share:
            return (f"this peer holds {held_amount} {self.unit} of {self.what}, {amount} more would pass its share "
                    f"of {share}")
        return None

    def _release(self, peer: str, amount: int) -> None:
        self.count -= 1
        self.amount -= amount
        self.peer_counts[peer] -= 1
        self.peer_amounts[peer] -= amount
        if not self.peer_counts[peer]:
            del self.peer_counts[peer], self.peer_amounts[peer]  # a peer that left holds no memory here
        if not self.count:
            TRIMMER.idle(self)

    def info(self) -> dict:
        return {"in_flight": self.count, self.unit: self.amount, "peers": len(self.peer_counts),
                "refused": self.refused}


class Grant:
    """What one request holds in an :class:`Admission`; released once (later calls do nothing).

    As a context manager it is released on exit unless it was handed on to whatever outlives the block (the
    compute thread, a background push), which then releases it."""

    def __init__(self, admission: Admission, peer: str, amount: int):
        self.admission, self.peer, self.amount = admission, peer, amount
        self.released = self.handed_on = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission._release(self.peer, self.amount)

    def hand_on(self) -> "Grant":
        self.handed_on = True
        return self

    def __enter__(self) -> "Grant":
        return self

    def __exit__(self, *exc) -> None:
        if not self.handed_on:
            self.release()


class ComputeQueue:
    """One compute thread behind an :class:`Admission` of requests and tokens.

    Requests run one at a time in arrival order (torch uses its own threads inside each). A request keeps
    its place until its work has left the thread, even when its caller stopped waiting (a timeout): the
    thread's backlog is what the bounds are about.
    """

    def __init__(self, max_concurrent: int, max_queued_tokens: Optional[int] = None, name: str = "compute",
                 peer_share: float = 1.0):
        self.admission = Admission("requests", max_concurrent, max_queued_tokens, "tokens", peer_share)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    @property
    def in_flight(self) -> int:
        return self.admission.count

    @property
    def queued_tokens(self) -> int:
        return self.admission.amount

    def admit(self, peer: str, tokens: int) -> Grant:
        """Take a place before the request's payload is received or decoded (see :class:`Admission`)."""
        return self.admission.acquire(peer, tokens)

    async def run(self, tokens: int, fn: Callable[..., T], *args, peer: str = "", grant: Optional[Grant] = None) -> T:
        """Run ``fn(*args)`` on the compute thread under ``grant`` (taken here for ``peer`` when None)."""
        with grant if grant is not None else self.admit(peer, tokens) as held:
            loop = asyncio.get_running_loop()
            work: Future = self.executor.submit(fn, *args)
            # Released when the work leaves the thread (done, failed, or cancelled before it started).
            work.add_done_callback(lambda _: _call_soon(loop, held.release))
            held.hand_on()
        return await asyncio.wrap_future(work)

    def info(self) -> dict:
        return self.admission.info()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """Run ``callback`` on ``loop`` from any thread; nothing when the loop has closed (the server is gone)."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        pass


class SpanBackend:
    """Runs forward passes of one span; refuses work beyond its bounds instead of queueing forever.

    With ``head`` (the final norm and output head, for a span ending at the last block) a pass can end with the
    sampler's predictions instead of hidden states (:func:`swarm.diffusion.prediction.predict_states`)."""

    def __init__(self, span: BlockSpan, max_concurrent: int, device: str = "cpu",
                 max_queued_tokens: Optional[int] = None, peer_share: float = 1.0,
                 head: Optional[OutputHead] = None):
        self.span = span.requires_grad_(False)  # frozen: a backward call computes the inputs' gradient only
        self.head = head.requires_grad_(False) if head is not None else None
        self.device = torch.device(device)
        self.dtype = next(span.parameters()).dtype
        self.queue = ComputeQueue(max_concurrent, max_queued_tokens, "span-compute", peer_share)

    @property
    def in_flight(self) -> int:
        return self.queue.in_flight

    @property
    def queued_tokens(self) -> int:
        return self.queue.queued_tokens

    @property
    def start(self) -> int:
        return self.span.start

    @property
    def end(self) -> int:
        return self.span.end

    @torch.inference_mode()
    def forward_sync(self, hidden: torch.Tensor, start: int, end: int, kv: Optional[SpanKV] = None,
                     rows: Optional[tuple[int, int]] = None, head: Optional[HeadQuery] = None,
                     prompts: Optional[torch.Tensor] = None, prompt_kind: str = DEEP_PROMPT) -> torch.Tensor:
        """Run blocks ``start:end`` (a sub-span of the held one), filling or reusing ``kv`` (see BlockSpan), applying
        a per-block adapter's tensor before each block; with a ``head`` query, answer its predictions (float64)
        instead of the hidden states."""
        x = self.span(hidden.to(self.device, self.dtype), blocks=(start, end), kv=kv, rows=rows,
                      prompts=self._on_device(prompts), prompt_kind=prompt_kind)
        x = x.to(self.dtype)  # the compute dtype: the wire carries it as is by default (lossless)
        if head is None:
            return x.cpu()
        logits = self.head.scored_logits(x, rows[0] if rows is not None else 0, head.scored)
        return predict_states(logits.cpu(), head)

    async def forward(self, hidden: torch.Tensor, start: int, end: int, kv: Optional[SpanKV] = None,
                      rows: Optional[tuple[int, int]] = None, *, peer: str = "",
                      grant: Optional[Grant] = None, head: Optional[HeadQuery] = None,
                      prompts: Optional[torch.Tensor] = None, prompt_kind: str = DEEP_PROMPT) -> torch.Tensor:
        """The span's output; ``grant`` is the place :meth:`ComputeQueue.admit` gave the request (taken here
        for ``peer`` when None)."""
        tokens = hidden.shape[0] * hidden.shape[1]
        return await self.queue.run(tokens, self.forward_sync, hidden, start, end, kv, rows, head, prompts, prompt_kind,
                                    peer=peer, grant=grant)

    def _on_device(self, prompts: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A per-block adapter's tensor where the blocks compute, in float32 (each block adds them in its own dtype)."""
        return None if prompts is None else prompts.to(self.device, torch.float32)

    def backward_sync(self, inputs: torch.Tensor, grad_outputs: torch.Tensor, start: int, end: int,
                      prompts: Optional[torch.Tensor] = None, prompt_kind: str = DEEP_PROMPT
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The gradient of blocks ``start:end``'s input (float32), recomputing their forward with autograd, and
        of the per-block adapter's tensor when given (float32, else None).

        The weights take no gradient (they are frozen), so autograd keeps only the activations of this one pass,
        freed when it returns."""
        with torch.inference_mode(False), torch.enable_grad():
            x = inputs.to(self.device, self.dtype).requires_grad_(True)
            p = self._on_device(prompts)
            if p is not None:  # a leaf of its own: the tensor may be the store's, shared with other requests
                p = p.detach().requires_grad_(True)
            leaves = (x,) if p is None else (x, p)
            y = self.span(x, blocks=(start, end), prompts=p, prompt_kind=prompt_kind)
            grads = torch.autograd.grad(y, leaves, grad_outputs.to(self.device, y.dtype))
        return grads[0].float().cpu(), grads[1].float().cpu() if p is not None else None

    async def backward(self, inputs: torch.Tensor, grad_outputs: torch.Tensor, start: int, end: int, *,
                       peer: str = "", grant: Optional[Grant] = None, prompts: Optional[torch.Tensor] = None,
                       prompt_kind: str = DEEP_PROMPT) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """:meth:`backward_sync` on the compute thread, under the same queue and bounds as forward passes."""
        tokens = 2 * inputs.shape[0] * inputs.shape[1]
        return await self.queue.run(tokens, self.backward_sync, inputs, grad_outputs, start, end, prompts, prompt_kind,
                                    peer=peer, grant=grant)

    def shutdown(self) -> None:
        self.queue.shutdown()
