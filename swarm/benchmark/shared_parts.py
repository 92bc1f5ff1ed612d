"""A checkpoint whose client parts are read once for all the benchmark's in-process clients.

Each user's client holds its own embedding and head on its own machine. The benchmark runs its clients in one
process, and at LLaDA-8B's widths each copy is about 2 GB: 16 copies do not fit beside the server on a small
machine, though they change nothing that is measured (the parts are only read, under inference mode).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from swarm.models.loading import ModelFiles
from swarm.models.modules import OutputHead, TokenEmbedding


class SharedClientParts(ModelFiles):
    """``ModelFiles`` that builds the embedding and the head once per dtype and hands every caller the same one."""

    def __init__(self, name_or_path: str) -> None:
        super().__init__(name_or_path)
        self._parts: dict[tuple[str, torch.dtype], torch.nn.Module] = {}

    def _shared(self, part: str, dtype: Optional[str | torch.dtype], load: Callable) -> torch.nn.Module:
        key = (part, self._dtype(dtype))
        if key not in self._parts:
            self._parts[key] = load(dtype)
        return self._parts[key]

    def embedding(self, dtype: Optional[str | torch.dtype] = None) -> TokenEmbedding:
        return self._shared("embedding", dtype, super().embedding)

    def head(self, dtype: Optional[str | torch.dtype] = None) -> OutputHead:
        return self._shared("head", dtype, super().head)
