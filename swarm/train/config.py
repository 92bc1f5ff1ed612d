"""What a training run is asked to do (:class:`TrainConfig`) and the built-in corpora's names: plain data importing
nothing heavy, so that ``python -m swarm.train --help`` and ``python -m swarm.eval --help`` declare their options
(defaults, choices) without loading torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

BUILTIN_CORPORA = ("prose", "python", "addition")
# Corpora that are also tasks with checkable answers (``python -m swarm.eval --task``): the keys of
# ``swarm.train.data.TASKS``.
TASK_NAMES = ("addition", "tagged-addition", "bracketed-addition", "dotted-addition", "host-blocks")
# Flags that set a new run's architecture; a resumed run keeps its checkpoint's.
ARCHITECTURE_FIELDS = ("hidden_size", "layers", "heads", "kv_heads", "intermediate_size")


@dataclass
class TrainConfig:
    output: str
    corpus: str = "prose"
    data_files: tuple[str, ...] = ()
    steps: int = 2000
    batch_size: int = 32
    seq_len: int = 128
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    hidden_size: int = 192
    layers: int = 16
    heads: int = 6
    kv_heads: int = 2
    intermediate_size: int = 512
    seed: int = 0
    save_every: int = 500
    save_dtype: str = "float16"
    threads: Optional[int] = None
    # "byte", or a subword tokenizer: its tokenizer.json or a directory holding one (copied into the run).
    tokenizer: str = "byte"
