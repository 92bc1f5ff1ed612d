"""Request bodies of the OpenAI-style endpoints, plus the diffusion settings as extra body fields.

Fields of the OpenAI API that change nothing for a diffusion model (``top_p``, ``user``, penalties…) are
accepted and ignored, so that existing clients work unchanged; fields whose meaning we cannot honour
(``n`` > 1) are refused with a 400 rather than silently answered wrongly. Integers are strict: ``"8"`` or
``8.5`` for ``steps`` is a client bug worth reporting, not something to guess about. The diffusion settings
are not written here: they are made from the declared settings (name, type, help text) of
:class:`~swarm.diffusion.config.GenerationConfig` and :class:`~swarm.frontend.lm.GenerationRequest`, whose bounds are
checked there, the same for the Python API; only the API's own field, ``stop``, is bounded here.
"""
from __future__ import annotations

from typing import Any, Iterable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, create_model, field_validator

from swarm.api.errors import APIRequestError
from swarm.diffusion.config import GenerationConfig, SettingField, settings_of
from swarm.frontend.lm import GenerationRequest

MAX_STOP_SEQUENCES = 4  # as OpenAI's API
MAX_STOP_CHARS = 1000
STRICT_TYPES: dict[Any, Any] = {int: StrictInt, bool: StrictBool}  # "8" for an integer is a client bug

GENERATION_KEYS = tuple(field.name for field in settings_of(GenerationConfig) if field.spec.api)
REQUEST_KEYS = tuple(field.name for field in settings_of(GenerationRequest) if field.spec.api)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SettingsFields(BaseModel):
    """What the request models do with the settings; the fields themselves come from :func:`settings_model`."""

    model_config = ConfigDict(extra="ignore")

    def length_aliases(self) -> dict[str, Optional[int]]:
        """Fields that all mean "how many tokens"; subclasses add OpenAI's names."""
        return {"gen_length": getattr(self, "gen_length", None)}

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
        """The per-request options of ``generate_stream`` that are not sampler settings (experts, tier, scale...)."""
        return {key: getattr(self, key) for key in REQUEST_KEYS if getattr(self, key) is not None}


def api_field(field: SettingField) -> tuple[Any, Any]:
    """The pydantic field of one declared setting: optional (unset keeps the default), strict for ints and bools."""
    return Optional[STRICT_TYPES.get(field.kind, field.kind)], Field(None, description=field.describe())


def settings_model(fields: Iterable[SettingField], name: str = "DiffusionSettings") -> type[SettingsFields]:
    """A request model with one optional field per setting (same names as ``generate`` and the CLI's options)."""
    return create_model(name, __base__=SettingsFields, __module__=__name__,
                        **{field.name: api_field(field) for field in fields})


DiffusionSettings = settings_model(
    field for cls in (GenerationConfig, GenerationRequest) for field in settings_of(cls) if field.spec.api)
DiffusionSettings.__doc__ = """The settings of ``generate`` as optional fields (same names as its keywords and the CLI's
options); unset ones keep their defaults."""


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

    @field_validator("stop")
    @classmethod
    def _few_short_stops(cls, stop: Union[str, list[str], None]) -> Union[str, list[str], None]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
        return stop

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
