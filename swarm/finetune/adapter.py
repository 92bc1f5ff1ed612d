"""Adapters: what fine-tuning learns, held by the client, and how a generation applies them.

An adapter is a *soft prompt* (Petals' shallow "ptune"): ``P`` trainable vectors of the model's hidden size
prepended to the embedded sequence. Servers need nothing to serve it: they only see ``P`` more positions, so
caching, failover, push and every sampler setting work unchanged, and only training needs a backward call. The
client slices the ``P`` prompt rows off before its head, so position i still scores token i (Dream's one-row
shift applies within the real rows, as without an adapter).

An adapter directory holds ``adapter.json`` (kind, sizes, the base model it was trained on, training metadata)
and ``adapter.safetensors`` (the prompt vectors, float32). Loading checks every field, the sizes, finiteness and
that the base model matches the one it is applied to, and refuses anything else with :class:`AdapterError`.
"""
from __future__ import annotations

import hashlib
import json
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


@dataclass(frozen=True)
class AdapterConfig:
    """``adapter.json``: the adapter's kind and sizes, its base model and how it was trained."""

    prompt_length: int
    hidden_size: int
    base: dict[str, Any]
    kind: str = SOFT_PROMPT
    training: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "prompt_length": self.prompt_length, "hidden_size": self.hidden_size,
                "base": dict(self.base), "training": dict(self.training)}

    @classmethod
    def from_dict(cls, value: Any) -> "AdapterConfig":
        """Refuses anything malformed with :class:`AdapterError` (the file may come from anyone)."""
        if not isinstance(value, dict):
            raise AdapterError(f"{ADAPTER_CONFIG} must hold a JSON object")
        kind, length, hidden = value.get("kind"), value.get("prompt_length"), value.get("hidden_size")
        if kind != SOFT_PROMPT:
            raise AdapterError(f"unknown adapter kind {kind!r}; this version knows {SOFT_PROMPT!r}")
        for name, number in (("prompt_length", length), ("hidden_size", hidden)):
            if not isinstance(number, int) or isinstance(number, bool) or number < 1:
                raise AdapterError(f"{ADAPTER_CONFIG}: {name} must be a positive integer, got {number!r}")
        if length > MAX_PROMPT_LENGTH:
            raise AdapterError(f"prompt_length {length} is over the limit of {MAX_PROMPT_LENGTH}")
        base, training = value.get("base"), value.get("training", {})
        if not isinstance(base, dict) or not isinstance(training, dict):
            raise AdapterError(f"{ADAPTER_CONFIG}: 'base' and 'training' must be objects")
        return cls(length, hidden, base, kind, training)

    def require_base(self, base: dict[str, Any], name: str = "") -> None:
        """Refuse an adapter trained on another base model, naming every difference."""
        differ = [f"{key} {self.base.get(key)!r} (this model: {value!r})" for key, value in base.items()
                  if self.base.get(key) != value]
        if differ:
            raise AdapterError(f"adapter {name or ''} was trained on another base model: {'; '.join(differ)}".strip())


class SoftPrompt(nn.Module):
    """``P`` trainable vectors prepended to the embedded sequence (see the module doc)."""

    def __init__(self, config: AdapterConfig, prompts: Optional[torch.Tensor] = None):
        super().__init__()
        self.config = config
        if prompts is None:
            prompts = torch.zeros(config.prompt_length, config.hidden_size)
        self.prompts = nn.Parameter(prompts.detach().float().clone())

    @classmethod
    def initialized(cls, config: AdapterConfig, embed: Callable[[torch.Tensor], torch.Tensor], vocab_size: int,
                    generator: torch.Generator) -> "SoftPrompt":
        """Start from the embeddings of random vocabulary entries: vectors of the scale the blocks expect."""
        ids = torch.randint(0, vocab_size, (config.prompt_length,), generator=generator)
        with torch.no_grad():
            return cls(config, embed(ids).detach().float())

    @property
    def length(self) -> int:
        return self.config.prompt_length

    def extend(self, hidden: torch.Tensor) -> torch.Tensor:
        """(batch, P + length, hidden): the prompt vectors, in ``hidden``'s dtype, before each row's states."""
        prompts = self.prompts.to(hidden.dtype)[None].expand(hidden.shape[0], -1, -1)
        return torch.cat([prompts, hidden], dim=1)

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
        config = AdapterConfig(self.length, self.config.hidden_size, self.config.base, self.config.kind,
                               dict(self.config.training, **(training or {})))
        weights = directory / (ADAPTER_WEIGHTS + ".tmp")
        save_file({PROMPT_KEY: self.prompts.detach().float().contiguous()}, str(weights))
        weights.replace(directory / ADAPTER_WEIGHTS)
        meta = directory / (ADAPTER_CONFIG + ".tmp")
        meta.write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True))
        meta.replace(directory / ADAPTER_CONFIG)
        return directory

    @classmethod
    def load(cls, directory: str | Path, base: Optional[dict[str, Any]] = None) -> "SoftPrompt":
        """The adapter in ``directory``, checked (sizes, fields, shape, finite values, and ``base`` when given)."""
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
        return cls(config, check_prompts(tensors, config, str(weights_path)))


def check_prompts(tensors: dict[str, torch.Tensor], config: AdapterConfig, where: str) -> torch.Tensor:
    """The prompt tensor of an adapter file, refused unless it is exactly what the config declares."""
    if set(tensors) != {PROMPT_KEY}:
        raise AdapterError(f"{where} must hold exactly one tensor {PROMPT_KEY!r}, it holds {sorted(tensors)}")
    prompts = tensors[PROMPT_KEY]
    expected = (config.prompt_length, config.hidden_size)
    if tuple(prompts.shape) != expected or not prompts.is_floating_point():
        raise AdapterError(f"{where}: prompt has shape {tuple(prompts.shape)} {prompts.dtype}, expected {expected} "
                           f"floats")
    if not bool(torch.isfinite(prompts).all()):
        raise AdapterError(f"{where}: prompt contains NaN or infinite values")
    return prompts.float()


def check_fits(adapter: SoftPrompt, rows: int, max_positions: int) -> None:
    """A generation of ``rows`` positions plus the prompt must fit the model's context."""
    if rows + adapter.length > max_positions:
        raise AdapterError(f"{rows} positions and the adapter's {adapter.length} prompt vectors exceed the model's "
                           f"context of {max_positions}")

