"""The RPCs' requests and errors: what a forward, backward or expert call asks for (typed fields, checked
where they are read), and the error codes every answer may carry."""
from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from swarm.adapters.block import BlockAdapter
from swarm.diffusion.pipeline import CacheDirective
from swarm.diffusion.prediction import HeadQuery
from swarm.utils.errors import SwarmError

if TYPE_CHECKING:
    from swarm.wire.stamp_value import WorkStamp

logger = logging.getLogger(__name__)


class ErrorCode(str, enum.Enum):
    BAD_REQUEST = "bad_request"  # malformed metadata or tensors
    WRONG_SPAN = "wrong_span"  # this server does not hold the requested blocks
    NO_EXPERT = "no_expert"  # this server does not host the requested expert
    TOO_LARGE = "too_large"  # over the batch-token or payload limit
    NOT_FINITE = "not_finite"  # NaN or infinite values
    BUSY = "busy"  # queue or memory full: route around this server
    SHUTTING_DOWN = "shutting_down"
    HALTED = "halted"
    CACHE_MISS = "cache_miss"  # a reuse request found no cache for its session here: the client fills again
    INCOMPLETE = "incomplete"  # a request's or an answer's stream lost parts on the way: the call is made again once
    NO_BACKWARD = "no_backward"  # this server does not answer backward calls (started with --no-backward)
    NO_ADAPTER = "no_adapter"  # this server does not serve the requested adapter files
    NO_WEIGHTS = "no_weights"  # this peer does not serve the requested model, file or tensor (swarm.weights)
    ADAPTER_MISS = "adapter_miss"  # a request named its adapter tensor by digest and this server no longer holds it
    INTERNAL = "internal"
    # Raised by the client about a server, never sent on the wire:
    TIMEOUT = "timeout"  # no answer within the request timeout (a hung or overloaded server)
    UNREACHABLE = "unreachable"  # connection refused, lost, or the peer is gone


MAX_RETRY_AFTER_S = 3600.0  # the longest retry hint a client takes from a server's answer


class RemoteError(SwarmError):
    """A structured error a server returned (or a client raised about a server). ``retry_after``: a busy server's
    hint, in seconds, of when to ask again (the wire's ``error.retry_after``; None when it gave none)."""

    def __init__(self, code: ErrorCode | str, message: str, peer_id: Optional[str] = None,
                 retry_after: Optional[float] = None):
        # a peer's error code may be anything its metadata decodes to (a list, a map): unknown ones are internal
        known = isinstance(code, str) and code in ErrorCode._value2member_map_
        self.code = ErrorCode(code) if known else ErrorCode.INTERNAL
        self.peer_id = peer_id
        self.retry_after = retry_hint(retry_after)
        super().__init__(f"[{self.code.value}] {message}" + (f" (peer {peer_id})" if peer_id else ""))
        self.message = message


def retry_hint(value: Any) -> Optional[float]:
    """A retry hint as a client may take it from the wire: seconds in (0, MAX_RETRY_AFTER_S], else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_RETRY_AFTER_S:
        return None  # NaN fails the comparison too
    return float(value)


@dataclass(frozen=True)
class PushSpec:
    """Where a pushed request's output goes next (``extra["push"]`` on the wire; servers check what they receive
    with :func:`swarm.server.push.parse_push`)."""

    route: tuple[tuple[str, int, int], ...]  # (peer id, start, end) of the hops after this one
    reply_to: str  # the client's peer id
    namespace: str  # the client's DeliveryService namespace
    push_id: str
    hop_delay: tuple[float, float] = (0.0, 0.0)  # emulated (latency, jitter) of each crossing

    def to_dict(self) -> dict[str, Any]:
        return {"route": [list(hop) for hop in self.route], "reply_to": self.reply_to, "namespace": self.namespace,
                "id": self.push_id, "hop_delay": list(self.hop_delay)}

    def onward(self) -> "PushSpec":
        """The spec the next hop receives: the same, minus that hop."""
        return dataclasses.replace(self, route=self.route[1:])


@dataclass
class ForwardRequest:
    """Hidden states for blocks ``start:end``, and what else the call asks for; on the wire the directives travel
    in the metadata's ``extra`` map (``cache``, ``head``, ``push``, ``work``) and the adapter as a second tensor (see
    the module doc)."""

    start: int
    end: int
    hidden: torch.Tensor
    session_id: str = ""
    step: int = -1
    _: KW_ONLY
    cache: Optional[CacheDirective] = None  # fill the session's activation cache, or reuse it for some rows
    head: Optional[HeadQuery] = None  # a head server at the last block answers predictions instead
    push: Optional[PushSpec] = None  # hand the output on to the next hops instead of answering it
    adapter: Optional[BlockAdapter] = None  # a per-block adapter for blocks start:end: (blocks, R, hidden) weights
    adapter_digest: Optional[str] = None  # send only this digest of ``adapter``: the server holds the weights
    work: Optional[WorkStamp] = None  # proof of work for the server's fair order (swarm.wire.work)

    @property
    def rows(self) -> int:
        """Positions carried: batch x length of the hidden states."""
        return self.hidden.shape[0] * self.hidden.shape[1]

    def directives(self) -> dict[str, Any]:
        """The metadata's ``extra`` map: each directive the request carries, as servers read it."""
        extra: dict[str, Any] = {}
        if self.cache is not None:
            extra["cache"] = self.cache.to_dict()
        if self.head is not None:
            extra["head"] = self.head.to_dict()
        if self.push is not None:
            extra["push"] = self.push.to_dict()
        if self.work is not None:
            extra["work"] = self.work.to_dict()
        return extra


@dataclass
class BackwardRequest:
    """The gradient of a span's input, given that input and the gradient of the span's output (see the module doc).

    Both travel in float32 whatever the model's dtype, so that gradients are not rounded on the wire."""

    start: int
    end: int
    inputs: torch.Tensor  # (batch, length, hidden): what the forward pass sent to the span
    grad_outputs: torch.Tensor  # (batch, length, hidden): d loss / d span output
    session_id: str = ""
    step: int = -1
    adapter: Optional[BlockAdapter] = None  # the per-block adapter the forward applied (its gradient is answered)

    def __post_init__(self) -> None:
        if self.inputs.shape != self.grad_outputs.shape:
            raise ValueError(f"inputs {tuple(self.inputs.shape)} and output gradients "
                             f"{tuple(self.grad_outputs.shape)} must have the same shape")

    def as_forward(self) -> ForwardRequest:
        """The wire form: one forward-shaped request whose tensor stacks inputs and gradients along the batch."""
        stacked = torch.cat([self.inputs.detach().float(), self.grad_outputs.detach().float()])
        return ForwardRequest(self.start, self.end, stacked, self.session_id, self.step, adapter=self.adapter)


@dataclass
class ExpertQuery:
    domain: str
    tokens: torch.Tensor  # (batch, length) token ids
    start: int  # positions whose log-probabilities are wanted: start:end
    end: int
    session_id: str = ""
    step: int = -1
    top_k: int = 0  # per position, the top_k most likely tokens only (swarm.diffusion.sparse); 0: every token
