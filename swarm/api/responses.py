"""Response bodies and stream events in the shape of the OpenAI API, for both endpoints.

How a diffusion step is streamed. OpenAI streams append-only token deltas, but a masked-diffusion model
fills positions anywhere in the current block, and nothing is final until the last step. So:

* every step is one event whose standard field (``choices[0].text`` / ``choices[0].delta.content``) is
  empty, and whose ``choices[0].diffusion`` object carries the whole partially unmasked text after that
  step (``text``, masks shown as ``_``) with ``step``, ``block`` and ``masked_left``: a diffusion-aware
  client redraws that text on every event;
* the last content event carries the complete final text in the standard field, with ``finish_reason``.

A plain OpenAI client that concatenates deltas therefore ends with exactly the final text, and never
shows tokens that a later step could still change.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from swarm.frontend.lm import GenerationResult, StreamChunk


@dataclass(frozen=True)
class ResponseShape:
    """What differs between ``/v1/completions`` and ``/v1/chat/completions``: names and choice layout."""

    object: str
    chunk_object: str
    id_prefix: str

    def choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, text: str, finish_reason: Optional[str], first: bool) -> dict[str, Any]:
        return self.choice(text, finish_reason)


class ChatShape(ResponseShape):
    def choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def chunk_choice(self, text: str, finish_reason: Optional[str], first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text or finish_reason:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


COMPLETION = ResponseShape("text_completion", "text_completion", "cmpl-")
CHAT = ChatShape("chat.completion", "chat.completion.chunk", "chatcmpl-")


def final_text(result: GenerationResult, stops: list[str]) -> tuple[str, str]:
    """The text cut at the first stop sequence, and OpenAI's finish reason (``stop`` or ``length``)."""
    text = result.text
    cuts = [text.find(stop) for stop in stops if stop in text]
    if cuts:
        return text[:min(cuts)], "stop"
    return text, "stop" if result.finish_reason == "eos" else "length"


def usage(result: GenerationResult) -> dict[str, int]:
    prompt, completion = len(result.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def run_details(result: GenerationResult) -> dict[str, Any]:
    """Diffusion facts a client may want beside the text (not part of the OpenAI schema)."""
    return {"steps": result.steps, "denoiser_calls": result.denoiser_calls,
            "elapsed_s": round(result.elapsed_s, 4), "model_finish_reason": result.finish_reason,
            "info": json.loads(json.dumps(result.info, default=str))}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event; OpenAI's stream ends with the literal ``[DONE]``."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


SSE_DONE = sse("[DONE]")


@dataclass
class ResponseBuilder:
    """Bodies of one request: they share its id, creation time and model name."""

    shape: ResponseShape
    model: str
    stops: list[str] = field(default_factory=list)
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or self.shape.id_prefix + uuid.uuid4().hex
        self.created = self.created or int(time.time())

    def envelope(self, object_: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def complete(self, result: GenerationResult) -> dict[str, Any]:
        text, reason = final_text(result, self.stops)
        return self.envelope(self.shape.object, [self.shape.choice(text, reason)], usage=usage(result),
                             diffusion=run_details(result))

    def step_event(self, chunk: StreamChunk, first: bool) -> dict[str, Any]:
        choice = self.shape.chunk_choice("", None, first)
        choice["diffusion"] = {"step": chunk.step, "block": chunk.block, "masked_left": chunk.masked_left,
                               "text": chunk.text, "tokens": chunk.tokens, "unmasked": chunk.unmasked,
                               "route": chunk.route, "failovers": chunk.failovers}
        return self.envelope(self.shape.chunk_object, [choice])

    def final_event(self, result: GenerationResult, first: bool) -> dict[str, Any]:
        text, reason = final_text(result, self.stops)
        return self.envelope(self.shape.chunk_object, [self.shape.chunk_choice(text, reason, first)],
                             diffusion=run_details(result))

    def usage_event(self, result: GenerationResult) -> dict[str, Any]:
        """Sent last when the client asked ``stream_options.include_usage``, as OpenAI does."""
        return self.envelope(self.shape.chunk_object, [], usage=usage(result))
