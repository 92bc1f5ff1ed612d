"""Request bodies of the OpenAI-style endpoints, plus the diffusion settings as extra body fields.

Fields of the OpenAI API that change nothing for a diffusion model (``top_p``, ``user``, penalties…) are
accepted and ignored, so that existing clients work unchanged; fields whose meaning we cannot honour
(``n`` > 1) are refused with a 400 rather than silently answered wrongly. Integers are strict: ``"8"`` or
``8.5`` for ``steps`` is a client bug worth reporting, not something to guess about.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from swarm.api.errors import APIRequestError
from swarm.cli_options import GENERATION_KEYS


class StreamOptions(BaseModel):
    include_usage: bool = False


class DiffusionSettings(BaseModel):
    """The sampler's settings (same names as ``generate`` and the CLI's options); unset ones keep defaults."""

    model_config = ConfigDict(extra="ignore")

    gen_length: Optional[StrictInt] = Field(None, description="Tokens to generate; same as max_tokens.")
    steps: Optional[StrictInt] = Field(None, description="Denoising steps (default: gen_length).")
    block_length: Optional[StrictInt] = Field(None, description="Semi-autoregressive block size.")
    temperature: Optional[float] = Field(None, description="Gumbel noise scale; 0 (the default) is greedy.")
    remasking: Optional[str] = Field(None, description="low_confidence, random, margin or entropy.")
    threshold: Optional[float] = Field(None, description="Unmask every position at least this confident.")
    cfg_scale: Optional[float] = Field(None, description="Unsupervised classifier-free guidance scale.")
    seed: Optional[StrictInt] = Field(None, description="Seed of the per-step noise: same seed, same text.")
    parallel_window: Optional[StrictInt] = Field(None, description="Picard window (1 is sequential).")
    staleness: Optional[StrictInt] = Field(None, description="0..3: steps may use logits this many steps old (0 is exact).")
    stale_check: Optional[str] = Field(None, description="Check of stale-decided steps: token (default), exact or none.")
    cache: Optional[str] = Field(None, description="Activation cache: none (exact), prefix or dual.")
    cache_refresh: Optional[StrictInt] = Field(None, description="Refill the cache every N steps (0: per block).")
    experts: Optional[Union[dict[str, float], str]] = Field(
        None, description='Experts composed each step: {"code": 0.5} or "auto" (docs/EXPERTS.md).')
    tier: Optional[str] = Field(None, description="A stricter safety tier: public, internal or restricted.")
    scale: Optional[str] = Field(None, description="How much of the swarm to use: local, auto or max.")

    def length_aliases(self) -> dict[str, Optional[int]]:
        """Fields that all mean "how many tokens"; subclasses add OpenAI's names."""
        return {"gen_length": self.gen_length}

    def generation_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``generate_stream``: only what the client set, lengths reconciled."""
        given = {name: value for name, value in self.length_aliases().items() if value is not None}
        if len(set(given.values())) > 1:
            raise APIRequestError(f"{' and '.join(given)} disagree ({given}); give one of them", param="max_tokens")
        kwargs = {key: getattr(self, key) for key in GENERATION_KEYS if getattr(self, key) is not None}
        kwargs.pop("gen_length", None)
        if given:
            kwargs["gen_length"] = next(iter(given.values()))
        return kwargs

    def request_kwargs(self) -> dict[str, Any]:
        """The per-request options of ``generate_stream`` that are not sampler settings."""
        return {key: getattr(self, key) for key in ("experts", "tier", "scale") if getattr(self, key) is not None}


class OpenAIFields(DiffusionSettings):
    """Fields both endpoints share."""

    model: str
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    n: StrictInt = 1

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported: send one request per completion (vary the seed)")
        return n

    @property
    def stop_sequences(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(OpenAIFields):
    """``POST /v1/completions``: one prompt, as text or as token ids."""

    prompt: Union[str, list[StrictInt], list[str]]
    max_tokens: Optional[StrictInt] = None

    def length_aliases(self) -> dict[str, Optional[int]]:
        return {"max_tokens": self.max_tokens, "gen_length": self.gen_length}

    def prompt_input(self) -> str | list[int]:
        """The single prompt; a one-element list of strings is accepted since some clients always send lists."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIRequestError("one prompt per request: send several requests for several prompts", "prompt")
            return prompt[0]
        return prompt


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(OpenAIFields):
    """``POST /v1/chat/completions``: a conversation, rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None

    def length_aliases(self) -> dict[str, Optional[int]]:
        return {"max_tokens": self.max_tokens, "max_completion_tokens": self.max_completion_tokens,
                "gen_length": self.gen_length}

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": message.role, "content": message.text()} for message in self.messages]
