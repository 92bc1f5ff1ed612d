"""One model behind the HTTP API: blocking generation moved off the event loop, one request at a time.

Generation is blocking torch (and, for the swarm, blocking RPC) code. Each request runs it in its own
worker thread that feeds the steps back to the event loop through a queue, so the server keeps answering
``/health`` and accepting streams while a request denoises. A lock serialises the model: its modules and
the distributed client's route and session state are shared by all requests, and one request at a time
gives each the whole machine (or route) instead of slowing every request down. Requests beyond
``max_pending`` are refused (503) instead of queueing without bound. A request whose caller stops
listening (a dropped connection, streamed or not) is cancelled: its worker stops after the current step,
or never starts if it was still waiting.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Mapping, Optional, Sequence

from swarm.diffusion.config import GenerationLimits, SettingError
from swarm.frontend.lm import BaseDiffusionLM, StreamChunk
from swarm.models.tokenizer import unicode_text
from swarm.utils.errors import SwarmError
from swarm.utils.text import plural

if TYPE_CHECKING:
    from swarm.dht.node import NetworkConfig

logger = logging.getLogger(__name__)


class EngineBusy(SwarmError, RuntimeError):
    """Too many requests are waiting for the model; becomes a 503 so clients back off and retry."""


@dataclass
class EngineStats:
    """Counts since the engine started: how requests ended and how much they computed."""

    finished: int = 0  # ran to their last step
    cancelled: int = 0  # their caller left: stopped after the current step, or before getting the model
    failed: int = 0  # raised (bad settings found late, a swarm error, ...)
    steps: int = 0  # denoising steps computed, over all requests


@dataclass
class _Failure:
    error: BaseException


_FINISHED = object()


class GenerationEngine:
    """Wraps a :class:`~swarm.frontend.lm.BaseDiffusionLM` (local or distributed) for concurrent async callers."""

    def __init__(self, lm: BaseDiffusionLM, model_id: str, max_pending: int = 16,
                 allowed_experts: Optional[frozenset[str]] = None):
        """``allowed_experts``: the expert names a request may ask for (None: any). A local model loads an
        expert by name or path, so an API open to others must not let a caller name any directory on disk."""
        self.lm = lm
        self.model_id = model_id
        self.max_pending = max_pending
        self.allowed_experts = allowed_experts
        self._lock = threading.Lock()
        self._pending = 0
        self._pending_lock = threading.Lock()  # also guards stats
        self.stats = EngineStats()

    @property
    def pending(self) -> int:
        """Requests generating or waiting for the model."""
        return self._pending

    @property
    def mode(self) -> str:
        """``swarm`` for a client of the swarm (it has a DHT peer), ``local`` for an in-process model."""
        return "swarm" if hasattr(self.lm, "dht") else "local"

    # ----- prompts ----------------------------------------------------------------------------------
    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a conversation, ready for the assistant's answer.

        Uses the tokenizer's chat template when it has one (LLaDA/Dream instruct checkpoints). Models without
        one (the project's byte-level models) get a plain ``Role: text`` transcript ending in ``Assistant:``,
        so chat clients still work with them, as a continuation of that transcript.
        """
        for message in messages:  # before the template, whose "no template" ValueError is caught below
            unicode_text(message["content"])
        template = getattr(self.lm.tokenizer, "apply_chat_template", None)
        if template is not None:
            try:
                return template([dict(m) for m in messages])
            except ValueError as error:
                logger.info("no chat template (%s); using a plain transcript", error)
        lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
        return self.lm.encode_prompt("\n".join(lines + ["Assistant:"]))

    def check_settings(self, settings: dict[str, Any]) -> None:
        """Raise the ValueError of any setting out of its bound now, before the request waits for the model."""
        self.lm.check_request(None, **settings)
        experts = settings.get("experts")
        if self.allowed_experts is not None and isinstance(experts, dict):
            refused = sorted(name for name in experts if name not in self.allowed_experts)
            if refused:
                raise SettingError(f"experts {', '.join(map(repr, refused))} are not served here; choose from "
                                   f"{', '.join(sorted(self.allowed_experts)) or 'none'}", param="experts")

    # ----- generation -------------------------------------------------------------------------------
    async def stream(self, prompt: str | list[int], settings: dict[str, Any]) -> AsyncIterator[StreamChunk]:
        """The steps of one generation as they happen; the last chunk has ``done`` and the result.

        Closing the iterator early (a client that hangs up) stops the worker after its current step.
        """
        with self._pending_lock:
            if self._pending >= self.max_pending:
                raise EngineBusy(f"{plural(self._pending, 'request')} already waiting for the model; retry later")
            self._pending += 1
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone: nobody is listening any more
                cancelled.set()

        def work() -> None:
            outcome = "failed"
            try:
                outcome = generate()
            except BaseException as error:  # handed to the request, which turns it into an HTTP error
                put(_Failure(error))
            finally:
                with self._pending_lock:
                    self._pending -= 1
                    setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
                put(_FINISHED)

        def generate() -> str:
            """Runs the generation under the model's lock; says how it ended (an :class:`EngineStats` field)."""
            with self._lock:
                if cancelled.is_set():
                    logger.info("request cancelled before it got the model")
                    return "cancelled"
                with contextlib.closing(self.lm.generate_stream(prompt, **settings)) as chunks:
                    for chunk in chunks:
                        if not chunk.done:
                            with self._pending_lock:
                                self.stats.steps += 1
                        put(chunk)
                        if cancelled.is_set() and not chunk.done:
                            logger.info("request cancelled; stopping generation after step %d", chunk.step)
                            return "cancelled"
            return "finished"

        threading.Thread(target=work, name="generation", daemon=True).start()
        try:
            while (item := await queue.get()) is not _FINISHED:
                if isinstance(item, _Failure):
                    raise item.error
                yield item
        finally:
            cancelled.set()

    # ----- health -----------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """Blocking: for the swarm, reads the health map and the governance records from the DHT (call it from a
        thread). A standing halt makes the report not ok, with ``halted`` saying why and since when."""
        report: dict[str, Any] = {"model": self.model_id, "mode": self.mode, "ok": True}
        if self.mode == "swarm":
            from swarm.health import read_health_map

            health = read_health_map(self.lm.dht, self.lm.prefix, self.lm.config.num_layers,
                                     probe_with=self.lm.caller)  # a server that died is not counted
            report.update(ok=health.fully_served, num_blocks=health.num_blocks, servers=len(health.servers),
                          uncovered=[list(span) for span in health.uncovered])
        guard = getattr(self.lm, "guard", None)
        decision = guard.current() if guard is not None else None
        if decision is not None and decision.halted:
            from swarm.cli.options import utc_time

            report.update(ok=False, halted={"reason": decision.reason, "sequence": decision.sequence,
                                            "signed_at": utc_time(decision.timestamp)})
        return report

    def close(self) -> None:
        """Release the swarm connection (if any)."""
        shutdown = getattr(self.lm, "shutdown", None)
        if shutdown is not None:
            shutdown()


def load_engine(model: str, *, local: bool, network: Optional["NetworkConfig"] = None,
                dht_prefix: Optional[str] = None, model_id: Optional[str] = None,
                max_pending: int = 16, request_memory_mb: Optional[int] = None,
                allow_experts: Sequence[str] = (),
                client_options: Optional[Mapping[str, Any]] = None) -> GenerationEngine:
    """The model a ``python -m swarm.api`` process serves: in this process (``local``) or through the swarm.

    The model id clients name defaults to the model's DHT prefix (its directory name, ``default`` for the
    embedded model), the same name servers and the health map use. ``request_memory_mb`` is the memory one
    request's denoiser calls may hold (default: a quarter of this machine's; see ``GenerationLimits``). A local
    model serves the embedded experts and the names or paths in ``allow_experts``, nothing else; through the
    swarm an expert name is a DHT domain, and any may be asked for. ``client_options`` set other
    :class:`~swarm.client.config.ClientConfig` fields (the command's client options).
    """
    from swarm.dht.schema import default_prefix
    from swarm.models.loading import embedded_models

    if local:
        from swarm.frontend.local import DiffusionLM

        lm: BaseDiffusionLM = DiffusionLM.from_pretrained(model)
        prefix = dht_prefix or default_prefix(lm.path)
    else:
        from swarm.client import ClientConfig, DistributedDiffusionLM
        from swarm.dht.node import NetworkConfig

        config = ClientConfig(network=network or NetworkConfig(client_mode=True), dht_prefix=dht_prefix,
                              **(client_options or {}))
        lm = DistributedDiffusionLM.from_pretrained(model, config=config)
        prefix = lm.prefix
    if request_memory_mb is not None:
        lm.limits = GenerationLimits.for_model(lm.config, memory_budget=request_memory_mb << 20)
    allowed = frozenset(embedded_models()) | frozenset(allow_experts) if local else None
    return GenerationEngine(lm, model_id or prefix, max_pending, allowed)
