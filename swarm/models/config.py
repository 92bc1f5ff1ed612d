"""Model configuration shared by every part of the model (embedding, block spans, head)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

DEFAULT_MODEL = "default"  # the embedded model every command and front end uses unless told otherwise
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the dtypes a model may be loaded in (--dtype)
# What activations may travel as (--wire-dtype): "auto" is the compute dtype. swarm.wire.encoding.WIRE_CHOICES, named
# here without torch for the settings' declarations (test_config_settings.py keeps the two equal).
WIRE_CHOICES = ("auto", "float32", "float16", "bfloat16")
# Settings a model may choose defaults for (its generation.json): those that change how its text reads, never
# lengths or budgets. Help texts say "model default" for them (swarm.cli.options).
MODEL_DEFAULT_SETTINGS = ("temperature", "remasking", "threshold", "cfg_scale")

CONFIG_FILE = "config.json"
NATIVE_MODEL_TYPE = "swarm-diffusion"


@dataclass(frozen=True)
class ModelConfig:
    """Shape and special tokens of a LLaMA-style bidirectional masked-diffusion transformer.

    One dataclass describes the project's own models as well as LLaDA and Dream: the differences are
    values (biases, GQA ratio, RoPE theta, mask id, logit shift), not code paths.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    mask_token_id: int
    pad_token_id: int
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    eot_token_id: Optional[int] = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    logits_shift: bool = False
    max_position_embeddings: int = 4096
    model_type: str = NATIVE_MODEL_TYPE
    tokenizer: str = "byte"
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary ({self.vocab_size})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, directory: str | Path) -> None:
        path = Path(directory) / CONFIG_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
