"""Checkpoint formats: the project's own layout, and LLaDA's and Dream's published Hugging Face layouts.

All three describe the same bidirectional LLaMA-style transformer (see :mod:`swarm.models.layers`); they
differ only in the keys of ``config.json`` and in tensor names. A format therefore is two pure functions:
``config.json`` -> :class:`ModelConfig`, and native tensor name -> stored tensor name. The model code never
learns which format it came from, and a server reading blocks 16:32 of LLaDA asks the
:class:`~swarm.models.checkpoint.CheckpointReader` for exactly those blocks' published names.

Facts below are taken from the published files, not guessed:

* LLaDA (``GSAI-ML/LLaDA-8B-*``, ``modeling_llada.py``, ``LLaDALlamaBlock``): tensors under
  ``model.transformer.``; per block ``attn_norm, q_proj, k_proj, v_proj, attn_out, ff_norm, ff_proj,
  up_proj, ff_out``; the MLP computes ``ff_out(act(ff_proj(x)) * up_proj(x))``, so **ff_proj is the SwiGLU
  gate**. Final norm ``ln_f``, output ``ff_out`` (absent when ``weight_tying``). Vocabulary rows are
  ``embedding_size or vocab_size``.
* Dream (``Dream-org/Dream-v0-*``, ``modeling_dream.py``): the Qwen2 layout, ``model.embed_tokens``,
  ``model.layers.N.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, input_layernorm,
  post_attention_layernorm}``, ``model.norm``, ``lm_head``. q/k/v always carry a bias (hard-coded
  ``bias=True`` in ``DreamAttention``), and the logits at position i predict token i+1: Dream's generation
  code shifts them right by one, which :func:`swarm.models.modules.align_logits` reproduces.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from swarm.models.config import CONFIG_FILE, NATIVE_MODEL_TYPE, ModelConfig
from swarm.utils.errors import EXIT_USAGE, SwarmError

logger = logging.getLogger(__name__)

NATIVE, LLADA, DREAM = "native", "llada", "dream"
DTYPE_NAMES = ("float32", "float16", "bfloat16")
BLOCK_NAME = re.compile(r"^blocks\.(\d+)\.(.+)$")


class UnsupportedCheckpoint(SwarmError, ValueError):
    """The directory is a checkpoint, but of an architecture variant this project does not implement."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class TensorLayout:
    """Maps native tensor names (``blocks.3.attn.q_proj.weight``) to a published layout's names."""

    top: dict[str, str]  # names outside the blocks
    block_prefix: str  # with ``{i}`` for the global block index
    block: dict[str, str]  # block-local native suffix -> stored suffix

    def __call__(self, native: str) -> str:
        match = BLOCK_NAME.match(native)
        if match:
            index, suffix = match.groups()
            if suffix in self.block:
                return self.block_prefix.format(i=index) + self.block[suffix]
        elif native in self.top:
            return self.top[native]
        raise KeyError(f"tensor {native!r} has no counterpart in this checkpoint layout")


def _identity(name: str) -> str:
    return name


_PROJ = ("q_proj", "k_proj", "v_proj")

LLADA_LAYOUT = TensorLayout(
    top={
        "embed.weight": "model.transformer.wte.weight",
        "norm.weight": "model.transformer.ln_f.weight",
        "lm_head.weight": "model.transformer.ff_out.weight",
    },
    block_prefix="model.transformer.blocks.{i}.",
    block={
        "attn_norm.weight": "attn_norm.weight",
        **{f"attn.{p}.{kind}": f"{p}.{kind}" for p in _PROJ for kind in ("weight", "bias")},
        "attn.o_proj.weight": "attn_out.weight",
        "mlp_norm.weight": "ff_norm.weight",
        "mlp.gate_proj.weight": "ff_proj.weight",  # LLaDALlamaBlock: act(ff_proj(x)) * up_proj(x)
        "mlp.up_proj.weight": "up_proj.weight",
        "mlp.down_proj.weight": "ff_out.weight",
    },
)

DREAM_LAYOUT = TensorLayout(
    top={
        "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
    },
    block_prefix="model.layers.{i}.",
    block={
        "attn_norm.weight": "input_layernorm.weight",
        **{f"attn.{p}.{kind}": f"self_attn.{p}.{kind}" for p in _PROJ for kind in ("weight", "bias")},
        "attn.o_proj.weight": "self_attn.o_proj.weight",
        "mlp_norm.weight": "post_attention_layernorm.weight",
        **{f"mlp.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
    },
)


@dataclass(frozen=True)
class CheckpointFormat:
    """How one family of checkpoints spells its config and tensors."""

    name: str
    convert_config: Callable[[dict[str, Any], Optional[Path]], ModelConfig]
    tensor_name: Callable[[str], str]  # native name -> stored name; what CheckpointReader(rename=...) takes
    # A transformers tokenizer class for checkpoints whose tokenizer_config.json names a class that exists only
    # as remote code (Dream's DreamTokenizer is a copy of Qwen2's). Remote code is never executed.
    tokenizer_fallback: Optional[str] = None

    def load_config(self, directory: str | Path) -> ModelConfig:
        return self.convert_config(read_raw_config(directory), Path(directory))


# ----- config conversion ------------------------------------------------------------------------------------
def read_raw_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {directory}: not a model checkpoint directory")
    return json.loads(path.read_text())


def _require(raw: dict[str, Any], supported: dict[str, tuple], family: str) -> None:
    """Refuse variants the shared block does not implement instead of computing something else silently.

    ``supported`` maps a config key to its allowed values; a missing key means the published default,
    which is supported.
    """
    wrong = {key: raw[key] for key, allowed in supported.items() if key in raw and raw[key] not in allowed}
    if wrong:
        settings = ", ".join(f"{k}={v!r} (supported: {supported[k]!r})" for k, v in wrong.items())
        raise UnsupportedCheckpoint(f"this {family} checkpoint uses settings the swarm does not implement: {settings}")


def _dtype_name(raw: dict[str, Any]) -> str:
    name = raw.get("torch_dtype")
    return name if name in DTYPE_NAMES else "bfloat16"  # both families publish bfloat16 weights


def _first(*values: Optional[int]) -> Optional[int]:
    return next((v for v in values if v is not None), None)


def special_token_id(directory: Optional[Path], content: str) -> Optional[int]:
    """The id of an added token such as ``<|eot_id|>``, read from the tokenizer files without loading them.

    Published configs do not carry end-of-turn ids; the tokenizer files do (``tokenizer_config.json``'s
    ``added_tokens_decoder``, ``tokenizer.json``'s ``added_tokens`` or ``added_tokens.json``). Without a
    directory (a config converted on its own) the answer is None.
    """
    def load(name: str) -> Any:
        if directory is None or not (directory / name).exists():
            return {}
        return json.loads((directory / name).read_text())

    for token_id, token in load("tokenizer_config.json").get("added_tokens_decoder", {}).items():
        if token.get("content") == content:
            return int(token_id)
    for token in load("tokenizer.json").get("added_tokens", []):
        if token.get("content") == content:
            return int(token["id"])
    added = load("added_tokens.json")
    return int(added[content]) if content in added else None


def _mask_id(raw: dict[str, Any], directory: Optional[Path], token: str, family: str) -> int:
    mask = _first(raw.get("mask_token_id"), special_token_id(directory, token))
    if mask is None:
        raise UnsupportedCheckpoint(f"{family} checkpoint at {directory} names no mask token "
                                    f"({token} or mask_token_id)")
    return int(mask)


# LLaDAConfig keys whose other values change the math or the tensor names (OLMo options LLaDA never uses).
LLADA_SUPPORTED: dict[str, tuple] = {
    "block_type": ("llama",), "activation_type": ("silu",), "layer_norm_type": ("rms",),
    "layer_norm_with_affine": (True,), "bias_for_layer_norm": (None, False), "include_bias": (False,),
    "alibi": (False,), "rope": (True,), "attention_layer_norm": (False,), "input_emb_norm": (False,),
    "scale_logits": (False,), "block_group_size": (1,), "clip_qkv": (None,), "yarn": (False,),
}


def llada_config(raw: dict[str, Any], directory: Optional[Path] = None) -> ModelConfig:
    """``LLaDAConfig`` (OLMo-style keys) -> ModelConfig; ``directory`` holds the tokenizer files, for special ids."""
    _require(raw, LLADA_SUPPORTED, "LLaDA")
    heads = raw["n_heads"]
    kv_heads = 1 if raw.get("multi_query_attention") else (raw.get("n_kv_heads") or heads)
    eos = raw.get("eos_token_id")
    return ModelConfig(
        vocab_size=raw.get("embedding_size") or raw["vocab_size"],
        hidden_size=raw["d_model"],
        intermediate_size=raw.get("mlp_hidden_size") or raw["mlp_ratio"] * raw["d_model"],
        num_layers=raw["n_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        mask_token_id=_mask_id(raw, directory, "<|mdm_mask|>", "LLaDA"),
        pad_token_id=_first(raw.get("pad_token_id"), eos, 0),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos,
        eot_token_id=special_token_id(directory, "<|eot_id|>"),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        qkv_bias=bool(raw.get("include_qkv_bias", False)),
        tie_word_embeddings=bool(raw.get("weight_tying", False)),
        logits_shift=False,
        max_position_embeddings=raw.get("max_sequence_length", 4096),
        model_type=raw.get("model_type", "llada"),
        tokenizer="hf",
        torch_dtype=_dtype_name(raw),
    )


DREAM_SUPPORTED: dict[str, tuple] = {"hidden_act": ("silu",), "use_sliding_window": (False,), "rope_scaling": (None,)}


def dream_config(raw: dict[str, Any], directory: Optional[Path] = None) -> ModelConfig:
    """``DreamConfig`` (Qwen2 keys) -> ModelConfig; q/k/v biases and the one-position logit shift are fixed."""
    _require(raw, DREAM_SUPPORTED, "Dream")
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    if raw.get("head_dim") not in (None, hidden // heads):
        raise UnsupportedCheckpoint(f"Dream head_dim {raw['head_dim']} differs from hidden_size / num_attention_heads")
    eos = raw.get("eos_token_id")
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        mask_token_id=_mask_id(raw, directory, "<|mask|>", "Dream"),
        pad_token_id=_first(raw.get("pad_token_id"), eos, 0),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos,
        eot_token_id=special_token_id(directory, "<|im_end|>"),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        qkv_bias=True,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        logits_shift=True,
        max_position_embeddings=raw.get("max_position_embeddings", 32768),
        model_type=raw.get("model_type", "Dream"),
        tokenizer="hf",
        torch_dtype=_dtype_name(raw),
    )


def native_config(raw: dict[str, Any], directory: Optional[Path] = None) -> ModelConfig:
    return ModelConfig.from_dict(raw)


FORMATS: dict[str, CheckpointFormat] = {
    NATIVE: CheckpointFormat(NATIVE, native_config, _identity),
    LLADA: CheckpointFormat(LLADA, llada_config, LLADA_LAYOUT),
    DREAM: CheckpointFormat(DREAM, dream_config, DREAM_LAYOUT, tokenizer_fallback="Qwen2Tokenizer"),
}


def format_of(raw: dict[str, Any]) -> CheckpointFormat:
    """Pick the format from ``config.json``'s contents.

    Native configs are recognised by their own keys (``num_layers``, no ``architectures``) rather than by
    ``model_type``, so a converted config saved back by :meth:`ModelConfig.save` stays native.
    """
    architectures = raw.get("architectures") or []
    model_type = str(raw.get("model_type", ""))
    if "architectures" not in raw and ("num_layers" in raw or model_type == NATIVE_MODEL_TYPE):
        return FORMATS[NATIVE]
    if model_type.lower() == "llada" or any(a.startswith("LLaDA") for a in architectures):
        return FORMATS[LLADA]
    if model_type.lower() == "dream" or "DreamModel" in architectures:
        return FORMATS[DREAM]
    raise UnsupportedCheckpoint(
        f"unknown checkpoint format (model_type={model_type!r}, architectures={architectures}); "
        f"supported: the native format, LLaDA (LLaDAModelLM) and Dream (DreamModel)"
    )


def detect_format(directory: str | Path) -> CheckpointFormat:
    fmt = format_of(read_raw_config(directory))
    logger.debug("checkpoint %s is in the %s format", directory, fmt.name)
    return fmt
