"""Adapters: what fine-tuning learns, held by the client, and how a generation applies them.

Two kinds, both ``P`` trainable vectors of the model's hidden size for ``P`` extra positions before the sequence:

* a *soft prompt* (``soft_prompt``, Petals' shallow "ptune"): the vectors are the states of the ``P`` positions
  before the first block. Servers need nothing to serve it: they only see ``P`` more positions, so caching,
  failover, push and every sampler setting work unchanged, and only training needs a backward call.
* a *deep prompt* (``deep_prompt``, Petals' "deep_ptune"): ``P`` vectors *per block*. The ``P`` positions start
  as zeros and before block i the vectors ``prompts[i]`` are added to their states, so the adapter steers every
  block, not only the input (:func:`swarm.models.modules.add_prompt`). Each forward and backward request carries
  the vectors of its span's blocks; the server adds them and its backward answers their gradient too.

The client slices the ``P`` prompt rows off before its head, so position i still scores token i (Dream's one-row
shift applies within the real rows, as without an adapter).

An adapter directory holds ``adapter.json`` (kind, sizes, the base model it was trained on, training metadata)
and ``adapter.safetensors`` (the prompt vectors, float32: (P, hidden) or (blocks, P, hidden)). Loading checks every
field, the sizes, finiteness and that the base model matches the one it is applied to, and refuses anything else
with :class:`AdapterError`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from swarm.dht.compatibility import CompatibilityTag

ADAPTER_CONFIG = "adapter.json"
ADAPTER_WEIGHTS = "adapter.safetensors"
PROMPT_KEY = "prompt"
SOFT_PROMPT = "soft_prompt"
DEEP_PROMPT = "deep_prompt"
KINDS = (SOFT_PROMPT, DEEP_PROMPT)
MAX_PROMPT_LENGTH = 256
MAX_CONFIG_BYTES = 64 * 1024
MAX_WEIGHTS_BYTES = 64 * 2**20  # 256 vectors of 65536 floats: far above any real prompt


class AdapterError(ValueError):
    """An adapter that cannot be used: missing, malformed, oversized, or trained on another base model."""


def base_of(config: Any, tokenizer: Any) -> dict[str, Any]:
    """What an adapter must share with the model it is applied to: the experts' compatibility tag (tokenizer,
    vocabulary, mask token) plus the widths and depth its vectors were trained against."""
    tag = CompatibilityTag.of(config, tokenizer).to_value()
    return {**tag, "hidden_size": int(config.hidden_size), "num_layers": int(config.num_layers)}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class AdapterConfig:
    """``adapter.json``: the adapter's kind and sizes, its base model and how it was trained.

    ``num_blocks`` is the depth a deep prompt has vectors for (0 for a soft prompt)."""

    prompt_length: int
    hidden_size: int
    base: dict[str, Any]
    kind: str = SOFT_PROMPT
    training: dict[str, Any] = field(default_factory=dict)
    num_blocks: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weights file's one tensor."""
        if self.kind == DEEP_PROMPT:
            return (self.num_blocks, self.prompt_length, self.hidden_size)
        return (self.prompt_length, self.hidden_size)

    def to_dict(self) -> dict[str, Any]:
        value = {"kind": self.kind, "prompt_length": self.prompt_length, "hidden_size": self.hidden_size,
                 "base": dict(self.base), "training": dict(self.training)}
        return dict(value, num_blocks=self.num_blocks) if self.kind == DEEP_PROMPT else value

    @classmethod
    def from_dict(cls, value: Any) -> "AdapterConfig":
        """Refuses anything malformed with :class:`AdapterError` (the file may come from anyone)."""
        if not isinstance(value, dict):
            raise AdapterError(f"{ADAPTER_CONFIG} must hold a JSON object")
        kind, length, hidden = value.get("kind"), value.get("prompt_length"), value.get("hidden_size")
        if kind not in KINDS:
            raise AdapterError(f"unknown adapter kind {kind!r}; this version knows {', '.join(map(repr, KINDS))}")
        numbers = [("prompt_length", length), ("hidden_size", hidden)]
        blocks = value.get("num_blocks", 0)
        if kind == DEEP_PROMPT:
            numbers.append(("num_blocks", blocks))
        for name, number in numbers:
            if not _positive_int(number):
                raise AdapterError(f"{ADAPTER_CONFIG}: {name} must be a positive integer, got {number!r}")
        if length > MAX_PROMPT_LENGTH:
            raise AdapterError(f"prompt_length {length} is over the limit of {MAX_PROMPT_LENGTH}")
        base, training = value.get("base"), value.get("training", {})
        if not isinstance(base, dict) or not isinstance(training, dict):
            raise AdapterError(f"{ADAPTER_CONFIG}: 'base' and 'training' must be objects")
        config = cls(length, hidden, base, kind, training, blocks if kind == DEEP_PROMPT else 0)
        if 4 * math.prod(config.shape) > MAX_WEIGHTS_BYTES:
            raise AdapterError(f"an adapter of shape {config.shape} has {4 * math.prod(config.shape)} bytes of "
                               f"float32, over the limit of {MAX_WEIGHTS_BYTES}")
        if kind == DEEP_PROMPT and "num_layers" in base and base["num_layers"] != blocks:
            raise AdapterError(f"{ADAPTER_CONFIG}: a deep prompt for {blocks} blocks cannot belong to a base model "
                               f"of {base['num_layers']!r} blocks")
        return config

    def require_base(self, base: dict[str, Any], name: str = "") -> None:
        """Refuse an adapter trained on another base model, naming every difference."""
        differ = [f"{key} {self.base.get(key)!r} (this model: {value!r})" for key, value in base.items()
                  if self.base.get(key) != value]
        if differ:
            raise AdapterError(f"adapter {name or ''} was trained on another base model: {'; '.join(differ)}".strip())


class PromptAdapter(nn.Module):
    """``P`` trainable vectors for ``P`` positions before the sequence; the kinds differ in where they enter the
    model (see the module doc). :meth:`load` reads either kind."""

    kind = ""

    def __init__(self, config: AdapterConfig, prompts: Optional[torch.Tensor] = None):
        super().__init__()
        if config.kind != self.kind:
            raise AdapterError(f"a {type(self).__name__} needs an adapter config of kind {self.kind!r}, "
                               f"not {config.kind!r}")
        self.config = config
        if prompts is None:
            prompts = torch.zeros(config.shape)
        if tuple(prompts.shape) != config.shape:
            raise AdapterError(f"prompt vectors of shape {tuple(prompts.shape)}, expected {config.shape}")
        self.prompts = nn.Parameter(prompts.detach().float().clone())

    @property
    def length(self) -> int:
        return self.config.prompt_length

    @property
    def block_prompts(self) -> Optional[torch.Tensor]:
        """(blocks, P, hidden) vectors added before each block (a deep prompt), or None."""
        return None

    def extend(self, hidden: torch.Tensor) -> torch.Tensor:
        """(batch, P + length, hidden): the prompt positions' first states, in ``hidden``'s dtype, before each
        row's states."""
        prompts = self.input_states().to(hidden.dtype)[None].expand(hidden.shape[0], -1, -1)
        return torch.cat([prompts, hidden], dim=1)

    def input_states(self) -> torch.Tensor:
        """(P, hidden): the states of the prompt positions before the first block."""
        raise NotImplementedError

    def strip(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows of the real positions, the prompt rows sliced off (before the head)."""
        return hidden[:, self.length:]

    def shift(self, rows: Optional[tuple[int, int]]) -> Optional[tuple[int, int]]:
        """Absolute rows ``a:b`` of the sequence as rows of the extended one."""
        return None if rows is None else (rows[0] + self.length, rows[1] + self.length)

    def digest(self) -> str:
        """sha256 of the vectors' float32 bytes: names the exact weights (publishing, reports)."""
        return hashlib.sha256(self.prompts.detach().float().contiguous().numpy().tobytes()).hexdigest()

    # ----- files -----------------------------------------------------------------------------------
    def save(self, directory: str | Path, training: Optional[dict[str, Any]] = None) -> Path:
        """Write ``adapter.json`` and ``adapter.safetensors`` (each replaced whole, never half written)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = dataclasses.replace(self.config, training=dict(self.config.training, **(training or {})))
        weights = directory / (ADAPTER_WEIGHTS + ".tmp")
        save_file({PROMPT_KEY: self.prompts.detach().float().contiguous()}, str(weights))
        weights.replace(directory / ADAPTER_WEIGHTS)
        meta = directory / (ADAPTER_CONFIG + ".tmp")
        meta.write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True))
        meta.replace(directory / ADAPTER_CONFIG)
        return directory

    @classmethod
    def load(cls, directory: str | Path, base: Optional[dict[str, Any]] = None) -> "PromptAdapter":
        """The adapter in ``directory``, of the kind its ``adapter.json`` names, checked (sizes, fields, shape,
        finite values, and ``base`` when given)."""
        directory = Path(directory)
        config_path, weights_path = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
        for path, limit in ((config_path, MAX_CONFIG_BYTES), (weights_path, MAX_WEIGHTS_BYTES)):
            if not path.is_file():
                raise AdapterError(f"{directory} is not an adapter directory: {path.name} is missing")
            if path.stat().st_size > limit:
                raise AdapterError(f"{path} has {path.stat().st_size} bytes, over the limit of {limit}")
        try:
            config = AdapterConfig.from_dict(json.loads(config_path.read_text()))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise AdapterError(f"{config_path} is not valid JSON: {error}") from None
        if base is not None:
            config.require_base(base, str(directory))
        try:
            tensors = load_file(str(weights_path))
        except Exception as error:  # safetensors raises its own error types on corrupt headers
            raise AdapterError(f"{weights_path} is not a valid safetensors file: {error}") from None
        return ADAPTER_KINDS[config.kind](config, check_prompts(tensors, config, str(weights_path)))


class SoftPrompt(PromptAdapter):
    """``P`` trainable vectors prepended to the embedded sequence (see the module doc)."""

    kind = SOFT_PROMPT

    @classmethod
    def initialized(cls, config: AdapterConfig, embed: Callable[[torch.Tensor], torch.Tensor], vocab_size: int,
                    generator: torch.Generator) -> "SoftPrompt":
        """Start from the embeddings of random vocabulary entries: vectors of the scale the blocks expect."""
        ids = torch.randint(0, vocab_size, (config.prompt_length,), generator=generator)
        with torch.no_grad():
            return cls(config, embed(ids).detach().float())

    def input_states(self) -> torch.Tensor:
        return self.prompts


class DeepPrompt(PromptAdapter):
    """``P`` trainable vectors per block, added to the prompt positions' states before each block (see the module
    doc). Its first block's vectors play the part of a soft prompt."""

    kind = DEEP_PROMPT

    @classmethod
    def initialized(cls, config: AdapterConfig, embed: Callable[[torch.Tensor], torch.Tensor], vocab_size: int,
                    generator: torch.Generator) -> "DeepPrompt":
        """Block 0's vectors start as a soft prompt would (embeddings of random vocabulary entries), every other
        block's at zero: before training it is exactly that soft prompt, and each block learns a correction."""
        ids = torch.randint(0, vocab_size, (config.prompt_length,), generator=generator)
        prompts = torch.zeros(config.shape)
        with torch.no_grad():
            prompts[0] = embed(ids).detach().float()
        return cls(config, prompts)

    @property
    def block_prompts(self) -> torch.Tensor:
        return self.prompts

    def input_states(self) -> torch.Tensor:
        return torch.zeros(self.length, self.config.hidden_size, dtype=self.prompts.dtype)


ADAPTER_KINDS: dict[str, type[PromptAdapter]] = {SOFT_PROMPT: SoftPrompt, DEEP_PROMPT: DeepPrompt}


def new_adapter(kind: str, prompt_length: int, config: Any, base: dict[str, Any],
                embed: Callable[[torch.Tensor], torch.Tensor], generator: torch.Generator) -> PromptAdapter:
    """A freshly initialised adapter of ``kind`` for a model of ``config`` (its sizes read from it)."""
    if kind not in ADAPTER_KINDS:
        raise AdapterError(f"unknown adapter kind {kind!r}; choose one of {', '.join(KINDS)}")
    blocks = int(config.num_layers) if kind == DEEP_PROMPT else 0
    adapter_config = AdapterConfig(prompt_length, int(config.hidden_size), base, kind, num_blocks=blocks)
    return ADAPTER_KINDS[kind].initialized(adapter_config, embed, int(config.vocab_size), generator)


def check_prompts(tensors: dict[str, torch.Tensor], config: AdapterConfig, where: str) -> torch.Tensor:
    """The prompt tensor of an adapter file, refused unless it is exactly what the config declares."""
    if set(tensors) != {PROMPT_KEY}:
        raise AdapterError(f"{where} must hold exactly one tensor {PROMPT_KEY!r}, it holds {sorted(tensors)}")
    prompts = tensors[PROMPT_KEY]
    expected = config.shape
    if tuple(prompts.shape) != expected or not prompts.is_floating_point():
        raise AdapterError(f"{where}: prompt has shape {tuple(prompts.shape)} {prompts.dtype}, expected {expected} "
                           f"floats")
    if not bool(torch.isfinite(prompts).all()):
        raise AdapterError(f"{where}: prompt contains NaN or infinite values")
    return prompts.float()


def check_fits(adapter: PromptAdapter, rows: int, max_positions: int) -> None:
    """A generation of ``rows`` positions plus the prompt must fit the model's context."""
    if rows + adapter.length > max_positions:
        raise AdapterError(f"{rows} positions and the adapter's {adapter.length} prompt vectors exceed the model's "
                           f"context of {max_positions}")
