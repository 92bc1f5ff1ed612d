"""Adapters: what fine-tuning learns, held by the client, and how a generation applies them.

Four kinds. Two are ``P`` trainable vectors of the model's hidden size for ``P`` extra positions before the
sequence:

* a *soft prompt* (``soft_prompt``, Petals' shallow "ptune"): the vectors are the states of the ``P`` positions
  before the first block. Servers need nothing to serve it: they only see ``P`` more positions, so caching,
  failover, push and every sampler setting work unchanged, and only training needs a backward call.
* a *deep prompt* (``deep_prompt``, Petals' "deep_ptune"): ``P`` vectors *per block*. The ``P`` positions start
  as zeros and before block i the vectors ``prompts[i]`` are added to their states, so the adapter steers every
  block, not only the input (:func:`swarm.adapters.block.add_prompt`). Each forward and backward request carries
  the vectors of its span's blocks; the server adds them and its backward answers their gradient too.

Two add no positions: a *bottleneck adapter* (``bottleneck``, after Houlsby et al.'s adapters) is, per block, a
residual MLP of rank ``r`` applied to every row before the block (:func:`swarm.adapters.block.add_bottleneck`):
``(blocks, 2r, hidden)`` weights that travel per hop exactly like a deep prompt's vectors. It can change what every
position computes, where prompt vectors can only be attended to. A *LoRA* (``lora``, after Hu et al.) corrects
every projection of every block, attention's included, by ``up @ down`` of rank ``r``; per block its matrices are
packed into ``R`` rows of ``hidden`` (:mod:`swarm.adapters.lora`) and travel the same way. It is the closest an
adapter gets to training every weight, which is what learnt held-out addition on the default backbone.

Any kind may also carry a *head correction* (``head_rank`` > 0): LoRA on the output head, which the client holds,
``logits += (norm(h) @ down.T) @ up.T`` (:meth:`swarm.models.modules.OutputHead.project`). It never travels to a
server. It matters when the frozen head cannot express what the task needs: the default backbone never saw EOS as
a target, so its head cannot end an answer, and no adapter of the blocks alone learnt to (docs/TRAINING.md).

The client slices the ``P`` prompt rows off before its head, so position i still scores token i (Dream's one-row
shift applies within the real rows, as without an adapter).

An adapter directory holds ``adapter.json`` (kind, sizes, the base model it was trained on, training metadata)
and ``adapter.safetensors`` (float32: the main tensor ``prompt``, (P, hidden), (blocks, P, hidden),
(blocks, 2r, hidden) or a LoRA's (blocks, R, hidden), and the head correction's ``head_down`` and ``head_up`` when
there is one).
Loading checks every field, the sizes, finiteness and that the base model matches the one it is applied to, and
refuses anything else with :class:`AdapterError`.
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

from swarm.adapters.block import BlockAdapter
from swarm.adapters.kinds import (
    BOTTLENECK,
    DEEP_PROMPT,
    KINDS,
    LORA,
    MAX_PROMPT_LENGTH,
    MAX_RANK,
    PER_BLOCK_KINDS,
    RANKED_KINDS,
    SOFT_PROMPT,
    size_setting,
)
from swarm.adapters.lora import BlockWidths, new_lora_weights, unpack_lora
from swarm.dht.compatibility import CompatibilityTag
from swarm.models.modules import HeadLoRA
from swarm.utils.errors import EXIT_USAGE, SwarmError

ADAPTER_CONFIG = "adapter.json"
ADAPTER_WEIGHTS = "adapter.safetensors"
PROMPT_KEY = "prompt"
HEAD_DOWN_KEY, HEAD_UP_KEY = "head_down", "head_up"  # the head correction's tensors, when head_rank > 0
# Model widths an adapter's base records since LoRA, whose layout depends on them; adapters saved before (none of
# them a LoRA) lack them and do not depend on them.
LAYOUT_KEYS = ("num_heads", "num_kv_heads", "intermediate_size")
MAX_CONFIG_BYTES = 64 * 1024
MAX_WEIGHTS_BYTES = 64 * 2**20  # 256 vectors of 65536 floats: far above any real prompt


def max_block_rows(kind: str, widths: BlockWidths) -> int:
    """The most rows one block's slice of a per-block adapter of ``kind`` may have (what a server accepts)."""
    return widths.rows(MAX_RANK) if kind == LORA else MAX_PROMPT_LENGTH


class AdapterError(SwarmError, ValueError):
    """An adapter that cannot be used: missing, malformed, oversized, or trained on another base model."""

    exit_code = EXIT_USAGE


def base_of(config: Any, tokenizer: Any) -> dict[str, Any]:
    """What an adapter must share with the model it is applied to: the experts' compatibility tag (tokenizer,
    vocabulary, mask token) plus the widths and depth its vectors were trained against."""
    tag = CompatibilityTag.of(config, tokenizer).to_value()
    return {**tag, "hidden_size": int(config.hidden_size), "num_layers": int(config.num_layers),
            **{key: int(getattr(config, key)) for key in LAYOUT_KEYS}}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class AdapterConfig:
    """``adapter.json``: the adapter's kind and sizes, its base model and how it was trained.

    ``num_blocks`` is the depth a per-block adapter has weights for (0 for a soft prompt); ``rank`` is a
    bottleneck's or LoRA's (0 for the prompt kinds, whose ``prompt_length`` is 0 for the ranked kinds). A LoRA's
    layout follows from the widths its ``base`` records."""

    prompt_length: int
    hidden_size: int
    base: dict[str, Any]
    kind: str = SOFT_PROMPT
    training: dict[str, Any] = field(default_factory=dict)
    num_blocks: int = 0
    rank: int = 0
    head_rank: int = 0  # the head correction's rank (0: none)
    vocab_size: int = 0  # the head's vocabulary (set with a head correction)

    @property
    def head_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The shapes of the head correction's down and up projections."""
        return (self.head_rank, self.hidden_size), (self.vocab_size, self.head_rank)

    @property
    def weight_bytes(self) -> int:
        """Float32 bytes of every tensor the config declares."""
        head = sum(math.prod(shape) for shape in self.head_shapes) if self.head_rank else 0
        return 4 * (math.prod(self.shape) + head)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weights file's one tensor."""
        if self.kind == BOTTLENECK:
            return (self.num_blocks, 2 * self.rank, self.hidden_size)
        if self.kind == LORA:
            return (self.num_blocks, BlockWidths.of(self.base).rows(self.rank), self.hidden_size)
        if self.kind == DEEP_PROMPT:
            return (self.num_blocks, self.prompt_length, self.hidden_size)
        return (self.prompt_length, self.hidden_size)

    @property
    def size(self) -> int:
        """The number a user chose: the rank of a bottleneck, the vectors of a prompt."""
        return getattr(self, size_setting(self.kind))

    def to_dict(self) -> dict[str, Any]:
        value = {"kind": self.kind, "prompt_length": self.prompt_length, "hidden_size": self.hidden_size,
                 "base": dict(self.base), "training": dict(self.training)}
        if self.kind in PER_BLOCK_KINDS:
            value["num_blocks"] = self.num_blocks
        if self.kind in RANKED_KINDS:
            value["rank"] = self.rank
        if self.head_rank:
            value.update(head_rank=self.head_rank, vocab_size=self.vocab_size)
        return value

    @classmethod
    def from_dict(cls, value: Any) -> "AdapterConfig":
        """Refuses anything malformed with :class:`AdapterError` (the file may come from anyone)."""
        if not isinstance(value, dict):
            raise AdapterError(f"{ADAPTER_CONFIG} must hold a JSON object")
        kind, length, hidden = value.get("kind"), value.get("prompt_length"), value.get("hidden_size")
        if kind not in KINDS:
            raise AdapterError(f"unknown adapter kind {kind!r}; this version knows {', '.join(map(repr, KINDS))}")
        blocks, rank = value.get("num_blocks", 0), value.get("rank", 0)
        head_rank, vocab = value.get("head_rank", 0), value.get("vocab_size", 0)
        numbers = [("hidden_size", hidden)]
        numbers += [("rank", rank)] if kind in RANKED_KINDS else [("prompt_length", length)]
        if kind in PER_BLOCK_KINDS:
            numbers.append(("num_blocks", blocks))
        if head_rank != 0:
            numbers += [("head_rank", head_rank), ("vocab_size", vocab)]
        for name, number in numbers:
            if not _positive_int(number):
                raise AdapterError(f"{ADAPTER_CONFIG}: {name} must be a positive integer, got {number!r}")
        if kind in RANKED_KINDS and length != 0:
            raise AdapterError(f"{ADAPTER_CONFIG}: a {kind} adapter adds no positions: prompt_length must be 0, "
                               f"got {length!r}")
        for name, number in (("rank", rank if kind in RANKED_KINDS else 0), ("head_rank", head_rank)):
            if number > MAX_RANK:
                raise AdapterError(f"{name} {number} is over the limit of {MAX_RANK}")
        if kind not in RANKED_KINDS and length > MAX_PROMPT_LENGTH:
            raise AdapterError(f"prompt_length {length} is over the limit of {MAX_PROMPT_LENGTH}")
        base, training = value.get("base"), value.get("training", {})
        if not isinstance(base, dict) or not isinstance(training, dict):
            raise AdapterError(f"{ADAPTER_CONFIG}: 'base' and 'training' must be objects")
        if kind == LORA:
            for name in ("hidden_size", *LAYOUT_KEYS):
                if not _positive_int(base.get(name)):
                    raise AdapterError(f"{ADAPTER_CONFIG}: a LoRA's base must record the model's {name} (its layout "
                                       f"depends on it), got {base.get(name)!r}")
            if base["hidden_size"] != hidden or base["hidden_size"] % base["num_heads"]:
                raise AdapterError(f"{ADAPTER_CONFIG}: a LoRA's base widths do not fit together: hidden_size "
                                   f"{hidden} (base {base['hidden_size']}), {base['num_heads']} heads")
        config = cls(length, hidden, base, kind, training, blocks if kind in PER_BLOCK_KINDS else 0,
                     rank if kind in RANKED_KINDS else 0, head_rank, vocab if head_rank else 0)
        if config.weight_bytes > MAX_WEIGHTS_BYTES:
            raise AdapterError(f"an adapter of shape {config.shape} (head rank {head_rank}) has "
                               f"{config.weight_bytes} bytes of float32, over the limit of {MAX_WEIGHTS_BYTES}")
        if head_rank and "vocab_size" in base and base["vocab_size"] != vocab:
            raise AdapterError(f"{ADAPTER_CONFIG}: a head correction for a vocabulary of {vocab} cannot belong to a "
                               f"base model of {base['vocab_size']!r} tokens")
        if kind in PER_BLOCK_KINDS and "num_layers" in base and base["num_layers"] != blocks:
            raise AdapterError(f"{ADAPTER_CONFIG}: a {kind.replace('_', ' ')} for {blocks} blocks cannot belong to a "
                               f"base model of {base['num_layers']!r} blocks")
        return config

    def require_base(self, base: dict[str, Any], name: str = "") -> None:
        """Refuse an adapter trained on another base model, naming every difference."""
        differ = [f"{key} {self.base.get(key)!r} (this model: {value!r})" for key, value in base.items()
                  if self.base.get(key) != value and not (key in LAYOUT_KEYS and key not in self.base
                                                          and self.kind != LORA)]
        if differ:
            raise AdapterError(f"adapter {name or ''} was trained on another base model: {'; '.join(differ)}".strip())


class PromptAdapter(nn.Module):
    """An adapter's main trainable tensor and how it enters the model (see the module doc): ``P`` positions before
    the sequence (0 for a bottleneck) and, for the per-block kinds, a slice applied before each block; plus the
    optional head correction. :meth:`load` reads every kind."""

    kind = ""

    def __init__(self, config: AdapterConfig, prompts: Optional[torch.Tensor] = None,
                 head: Optional[HeadLoRA] = None):
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
        self.head_down: Optional[nn.Parameter] = None
        self.head_up: Optional[nn.Parameter] = None
        if config.head_rank:
            head = head if head is not None else tuple(torch.zeros(shape) for shape in config.head_shapes)
            for name, tensor, shape in zip((HEAD_DOWN_KEY, HEAD_UP_KEY), head, config.head_shapes):
                if tuple(tensor.shape) != shape:
                    raise AdapterError(f"{name} of shape {tuple(tensor.shape)}, expected {shape}")
                setattr(self, name, nn.Parameter(tensor.detach().float().clone()))
        elif head is not None:
            raise AdapterError("a head correction needs an adapter config with head_rank > 0")

    def init_head(self, generator: torch.Generator) -> None:
        """Down projection random (unit-scale outputs from the normed rows), up zero: the head starts unchanged."""
        if self.head_down is not None:
            with torch.no_grad():
                self.head_down.copy_(torch.randn(self.head_down.shape, generator=generator)
                                     / math.sqrt(self.config.hidden_size))
                self.head_up.zero_()

    def scale_down_projections(self, factor: float) -> None:
        """Multiply every down projection of a new adapter (the head correction's; a LoRA's or bottleneck's in
        the subclasses) by ``factor``, its up projections still zero. Under Adam this lets the up projections
        learn ``factor**2`` times faster than the down ones (LoRA+'s learning-rate ratio, without per-element
        learning rates): the product moves faster while the random directions stay steady."""
        if self.head_down is not None:
            with torch.no_grad():
                self.head_down.mul_(factor)

    @property
    def head_lora(self) -> Optional[HeadLoRA]:
        """(down, up) of the head correction, or None."""
        return None if self.head_down is None else (self.head_down, self.head_up)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every trained tensor by its name in the weights file (float32, detached)."""
        named = {PROMPT_KEY: self.prompts}
        if self.head_down is not None:
            named.update({HEAD_DOWN_KEY: self.head_down, HEAD_UP_KEY: self.head_up})
        return {name: tensor.detach().float().contiguous() for name, tensor in named.items()}

    @property
    def length(self) -> int:
        return self.config.prompt_length

    @property
    def block_adapter(self) -> Optional[BlockAdapter]:
        """The per-block part, its weights (blocks, R, hidden) this adapter's trainable tensor itself (a deep
        prompt's vectors, a bottleneck's or LoRA's weights), or None (a soft prompt)."""
        return BlockAdapter(self.kind, self.prompts) if self.kind in PER_BLOCK_KINDS else None

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
        """sha256 of the tensors' float32 bytes: names the exact weights (publishing, reports)."""
        digest = hashlib.sha256()
        for tensor in self.tensors().values():
            digest.update(tensor.numpy().tobytes())
        return digest.hexdigest()

    # ----- files -----------------------------------------------------------------------------------
    def save(self, directory: str | Path, training: Optional[dict[str, Any]] = None) -> Path:
        """Write ``adapter.json`` and ``adapter.safetensors`` (each replaced whole, never half written)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = dataclasses.replace(self.config, training=dict(self.config.training, **(training or {})))
        weights = directory / (ADAPTER_WEIGHTS + ".tmp")
        save_file(self.tensors(), str(weights))
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
        prompts, head = check_tensors(tensors, config, str(weights_path))
        return ADAPTER_KINDS[config.kind](config, prompts, head)


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

    def input_states(self) -> torch.Tensor:
        return torch.zeros(self.length, self.config.hidden_size, dtype=self.prompts.dtype)


class RankedAdapter(PromptAdapter):
    """A per-block adapter sized by a rank that adds no positions (a bottleneck, a LoRA): its whole tensor is
    applied per block."""

    def input_states(self) -> torch.Tensor:
        return torch.zeros(0, self.config.hidden_size, dtype=self.prompts.dtype)


class BottleneckAdapter(RankedAdapter):
    """Per block, a residual MLP of rank r on every row (see the module doc): no extra positions."""

    kind = BOTTLENECK

    @classmethod
    def initialized(cls, config: AdapterConfig, embed: Callable[[torch.Tensor], torch.Tensor], vocab_size: int,
                    generator: torch.Generator) -> "BottleneckAdapter":
        """Down projections random (unit-scale activations from the normed rows), up projections zero: before
        training the adapter is the identity, and the first gradients reach every down projection."""
        weights = torch.zeros(config.shape)
        weights[:, :config.rank] = torch.randn(config.num_blocks, config.rank, config.hidden_size,
                                               generator=generator) / math.sqrt(config.hidden_size)
        return cls(config, weights)

    def scale_down_projections(self, factor: float) -> None:
        super().scale_down_projections(factor)
        with torch.no_grad():
            self.prompts[:, :self.config.rank].mul_(factor)


class LoRAAdapter(RankedAdapter):
    """Per block, LoRA of rank r on every projection (:mod:`swarm.adapters.lora`): no extra positions."""

    kind = LORA

    @classmethod
    def initialized(cls, config: AdapterConfig, embed: Callable[[torch.Tensor], torch.Tensor], vocab_size: int,
                    generator: torch.Generator) -> "LoRAAdapter":
        """Down projections random, up projections zero: the identity before training, as a bottleneck."""
        return cls(config, new_lora_weights(BlockWidths.of(config.base), config.rank, config.num_blocks, generator))

    def scale_down_projections(self, factor: float) -> None:
        super().scale_down_projections(factor)
        widths = BlockWidths.of(self.config.base)
        with torch.no_grad():
            for block in self.prompts:
                for down, _ in unpack_lora(block, widths).values():
                    down.mul_(factor)


ADAPTER_KINDS: dict[str, type[PromptAdapter]] = {SOFT_PROMPT: SoftPrompt, DEEP_PROMPT: DeepPrompt,
                                                 BOTTLENECK: BottleneckAdapter, LORA: LoRAAdapter}


def new_adapter(kind: str, size: int, config: Any, base: dict[str, Any],
                embed: Callable[[torch.Tensor], torch.Tensor], generator: torch.Generator,
                head_rank: int = 0, down_scale: float = 1.0) -> PromptAdapter:
    """A freshly initialised adapter of ``kind`` for a model of ``config`` (its sizes read from it); ``size`` is
    the prompt's vectors, or the bottleneck's or LoRA's rank; ``head_rank`` > 0 adds a head correction; its down
    projections start ``down_scale`` times the unit scale (:meth:`PromptAdapter.scale_down_projections`)."""
    if kind not in ADAPTER_KINDS:
        raise AdapterError(f"unknown adapter kind {kind!r}; choose one of {', '.join(KINDS)}")
    blocks = int(config.num_layers) if kind in PER_BLOCK_KINDS else 0
    length, rank = (0, size) if kind in RANKED_KINDS else (size, 0)
    adapter_config = AdapterConfig(length, int(config.hidden_size), base, kind, num_blocks=blocks, rank=rank,
                                   head_rank=head_rank, vocab_size=int(config.vocab_size) if head_rank else 0)
    adapter = ADAPTER_KINDS[kind].initialized(adapter_config, embed, int(config.vocab_size), generator)
    adapter.init_head(generator)  # after the main tensor: adapters without a head draw what they always drew
    adapter.scale_down_projections(down_scale)  # x 1.0 leaves every float as drawn
    return adapter


def check_tensors(tensors: dict[str, torch.Tensor], config: AdapterConfig, where: str
                  ) -> tuple[torch.Tensor, Optional[HeadLoRA]]:
    """The main tensor and the head correction (None without one) of an adapter file, refused unless they are
    exactly what the config declares."""
    expected = {PROMPT_KEY: config.shape}
    if config.head_rank:
        expected.update(zip((HEAD_DOWN_KEY, HEAD_UP_KEY), config.head_shapes))
    if set(tensors) != set(expected):
        raise AdapterError(f"{where} must hold exactly the tensors {sorted(expected)}, it holds {sorted(tensors)}")
    for name, shape in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape or not tensor.is_floating_point():
            raise AdapterError(f"{where}: {name} has shape {tuple(tensor.shape)} {tensor.dtype}, expected {shape} "
                               f"floats")
        if not bool(torch.isfinite(tensor).all()):
            raise AdapterError(f"{where}: {name} contains NaN or infinite values")
    head = (tensors[HEAD_DOWN_KEY].float(), tensors[HEAD_UP_KEY].float()) if config.head_rank else None
    return tensors[PROMPT_KEY].float(), head


def check_fits(adapter: PromptAdapter, rows: int, max_positions: int) -> None:
    """A generation of ``rows`` positions plus the prompt must fit the model's context."""
    if rows + adapter.length > max_positions:
        raise AdapterError(f"{rows} positions and the adapter's {adapter.length} prompt vectors exceed the model's "
                           f"context of {max_positions}")
