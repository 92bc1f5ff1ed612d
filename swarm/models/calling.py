"""The calls a Hugging Face user makes on a tokenizer, on the project's tokenizers (issue 56): ``tokenizer(text)``
with ``return_tensors="pt"`` and ``padding``, ``decode`` of a tensor row and ``batch_decode``.

Mixed into every tokenizer of :mod:`swarm.models.tokenizer`; the ids are the ones ``encode`` gives (no special tokens
added: the sampler adds none either), padded on the right with the tokenizer's pad id.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

RETURN_TENSORS = (None, "pt")


class Encoding(dict):
    """``{"input_ids": ..., "attention_mask": ...}``, also read as attributes (``encoding.input_ids``), as a
    transformers ``BatchEncoding`` is; a local model's ``lm.logits(**encoding)`` takes it whole, the swarm client's
    ``lm.logits(encoding["input_ids"])`` its ids."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class TransformersCalls:
    """``__call__`` and ``batch_decode`` over a tokenizer's own ``encode``, ``decode`` and ``pad_token_id``."""

    pad_token_id: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], mask_placeholder: Optional[str] = None) -> str:
        raise NotImplementedError

    def __call__(self, text: Union[str, Sequence[str]], return_tensors: Optional[str] = None,
                 padding: Union[bool, str] = False, add_special_tokens: bool = False) -> Encoding:
        """Ids and attention mask of one text (flat) or several (one row each): lists, or with
        ``return_tensors="pt"`` int64 tensors of shape (rows, length); rows of different lengths need
        ``padding=True`` (or ``"longest"``) for a tensor, as in transformers."""
        if return_tensors not in RETURN_TENSORS:
            raise ValueError(f"return_tensors={return_tensors!r}: this tokenizer returns lists or 'pt' (torch) tensors")
        if add_special_tokens:
            raise ValueError("add_special_tokens=True: these models' prompts carry no special tokens (generate adds "
                             "none); leave it False")
        if padding not in (False, True, "longest", "do_not_pad"):
            raise ValueError(f"padding={padding!r}: True (or 'longest') pads to the longest row, False does not")
        single = isinstance(text, str)
        rows = [self.encode(item) for item in ([text] if single else list(text))]
        masks = [[1] * len(row) for row in rows]
        if padding in (True, "longest"):
            width = max((len(row) for row in rows), default=0)
            masks = [mask + [0] * (width - len(mask)) for mask in masks]
            rows = [row + [self.pad_token_id] * (width - len(row)) for row in rows]
        if return_tensors is None:
            return Encoding(input_ids=rows[0] if single else rows, attention_mask=masks[0] if single else masks)
        if len({len(row) for row in rows}) > 1:
            raise ValueError("the texts have different lengths: pass padding=True to make one tensor of them")
        import torch

        return Encoding(input_ids=torch.tensor(rows, dtype=torch.long),
                        attention_mask=torch.tensor(masks, dtype=torch.long))

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """The text of each row (a list of ids or a tensor's row); special tokens are always left out."""
        if not skip_special_tokens:
            raise ValueError("skip_special_tokens=False: these tokenizers always leave special tokens out")
        return [self.decode(row) for row in sequences]
