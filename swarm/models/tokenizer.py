"""Tokenizers: byte-level and subword (BPE) ones for the project's own models, and an adapter for Hugging Face's.

All satisfy :class:`Tokenizer`, which is all the generation code uses, and take the calls a transformers user makes
(``tokenizer(text, return_tensors="pt")``, ``batch_decode``: :mod:`swarm.models.calling`).
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Optional, Protocol, Sequence, runtime_checkable

from swarm.models.calling import TransformersCalls

logger = logging.getLogger(__name__)

MASK_PLACEHOLDER = "_"


def unicode_text(text: str) -> str:
    """``text`` if it is valid Unicode (encodable as UTF-8), else a ValueError naming the first bad character.

    JSON and Python strings can hold lone surrogates (``"\\ud800"``), which no tokenizer can encode: the Rust
    tokenizers fail with an unhelpful type error. Every tokenizer checks here, so every front end (Python, the
    command line, the HTTP API's prompts and chat messages) refuses such text the same way.
    """
    if not isinstance(text, str):
        raise ValueError(f"text to tokenize must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = ord(text[error.start])
        raise ValueError(f"the text is not valid Unicode: character {error.start} is a lone surrogate "
                         f"(U+{bad:04X}); send UTF-8 text") from None
    return text


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    mask_token_id: int
    pad_token_id: int
    bos_token_id: Optional[int]
    eos_token_id: Optional[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], mask_placeholder: Optional[str] = None) -> str: ...

    def encode_chat(self, text: str) -> list[int]:
        """``text`` as one user turn in the model's chat template, ready for the assistant's answer.

        Raises ValueError when the tokenizer has no chat template.
        """
        ...

    def fingerprint(self) -> str:
        """A short hash that two tokenizers share only when they map text to the same ids."""
        ...


class ByteTokenizer(TransformersCalls):
    """UTF-8 bytes are ids 0..255; then pad, bos, eos and mask."""

    PAD, BOS, EOS, MASK = 256, 257, 258, 259
    vocab_size = 260
    mask_token_id, pad_token_id, bos_token_id, eos_token_id = MASK, PAD, BOS, EOS

    def encode(self, text: str) -> list[int]:
        return list(unicode_text(text).encode("utf-8"))

    def decode(self, ids: Sequence[int], mask_placeholder: Optional[str] = None) -> str:
        """Bytes become text; specials are dropped, masks shown as ``mask_placeholder`` when given."""
        out = bytearray()
        for token in ids:
            token = int(token)
            if token < 256:
                out.append(token)
            elif token == self.MASK and mask_placeholder is not None:
                out.extend(mask_placeholder.encode("utf-8"))
        return out.decode("utf-8", errors="replace")

    def encode_chat(self, text: str) -> list[int]:
        raise ValueError(
            "chat=True needs a chat template, and the tokenizers of the project's own models have none; "
            "use an instruct checkpoint with a Hugging Face tokenizer (LLaDA-8B-Instruct, Dream-v0-Instruct-7B)"
        )

    def fingerprint(self) -> str:
        return "byte-v1"


class SubwordTokenizer(TransformersCalls):
    """A byte-level BPE vocabulary trained by the project (``tokenizer.json`` of the ``tokenizers`` library).

    Its first four ids are the specials the sampler needs (PAD, BOS, EOS, MASK); digits are always single
    tokens, so numbers read the same to the model wherever they stand.
    """

    FILE = "tokenizer.json"
    SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<mask>")

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        ids = [tokenizer.token_to_id(token) for token in self.SPECIAL_TOKENS]
        if any(i is None for i in ids):
            raise ValueError(f"a subword tokenizer needs the special tokens {', '.join(self.SPECIAL_TOKENS)}")
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.mask_token_id = ids
        self.special_ids = frozenset(ids)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: str | Path) -> "SubwordTokenizer":
        from tokenizers import Tokenizer as RustTokenizer

        return cls(RustTokenizer.from_file(str(path)))

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / self.FILE
        self.tokenizer.save(str(path))
        return path

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(unicode_text(text), add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], mask_placeholder: Optional[str] = None) -> str:
        """Text of the non-special ids; each MASK shown as ``mask_placeholder`` when given, dropped otherwise."""
        pieces, run = [], []
        for token in map(int, ids):
            if token == self.mask_token_id and mask_placeholder is not None:
                pieces.append(self.tokenizer.decode(run) + mask_placeholder)
                run = []
            elif token not in self.special_ids and 0 <= token < self.vocab_size:
                run.append(token)
        pieces.append(self.tokenizer.decode(run))
        return "".join(pieces)

    def encode_chat(self, text: str) -> list[int]:
        return ByteTokenizer().encode_chat(text)

    def fingerprint(self) -> str:
        return "bpe-" + hashlib.sha256(self.tokenizer.to_str().encode("utf-8")).hexdigest()[:16]


class HFTokenizer(TransformersCalls):
    """Adapts a ``transformers`` tokenizer (LLaDA, Dream) to :class:`Tokenizer`."""

    def __init__(self, tokenizer, mask_token_id: int, pad_token_id: Optional[int] = None,
                 eos_token_id: Optional[int] = None, vocab_size: Optional[int] = None):
        self.hf = tokenizer
        self.mask_token_id = mask_token_id
        self.eos_token_id = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        pad = pad_token_id if pad_token_id is not None else tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.eos_token_id
        self.vocab_size = vocab_size or len(tokenizer)

    @classmethod
    def from_directory(cls, directory: str | Path, fallback_class: Optional[str] = None, **kwargs) -> "HFTokenizer":
        """Load the tokenizer saved next to the weights, offline and without running the checkpoint's code.

        Some checkpoints name a tokenizer class that exists only as remote code (Dream's ``DreamTokenizer``,
        a copy of Qwen2's); ``fallback_class`` names the ``transformers`` class to use instead.
        """
        import transformers

        try:
            hf = transformers.AutoTokenizer.from_pretrained(
                str(directory), trust_remote_code=False, local_files_only=True
            )
        except ValueError as error:  # "contains custom code which must be executed"
            if fallback_class is None:
                raise
            logger.info("tokenizer at %s needs remote code (%s); loading it as %s", directory, error, fallback_class)
            hf = getattr(transformers, fallback_class).from_pretrained(str(directory), local_files_only=True)
        return cls(hf, **kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(unicode_text(text), add_special_tokens=False))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Render ``messages`` with the tokenizer's template and a generation prompt, then encode the text.

        Rendering to text first gives plain ids on every transformers version (v5 returns a BatchEncoding
        for ``tokenize=True``); the template writes its own special tokens (BOS, headers), so none are added.
        """
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this tokenizer has no chat template: use chat=False, or an instruct checkpoint")
        text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    def encode_chat(self, text: str) -> list[int]:
        return self.apply_chat_template([{"role": "user", "content": text}])

    def decode(self, ids: Sequence[int], mask_placeholder: Optional[str] = None) -> str:
        ids = [int(i) for i in ids]
        if mask_placeholder is None:
            return self.hf.decode([i for i in ids if i != self.mask_token_id], skip_special_tokens=True)
        pieces, run = [], []
        for token in ids:
            if token == self.mask_token_id:
                pieces.append(self.hf.decode(run, skip_special_tokens=True) + mask_placeholder)
                run = []
            else:
                run.append(token)
        pieces.append(self.hf.decode(run, skip_special_tokens=True))
        return "".join(pieces)

    def fingerprint(self) -> str:
        vocab = sorted(self.hf.get_vocab().items(), key=lambda item: item[1])
        digest = hashlib.sha256(repr(vocab).encode("utf-8")).hexdigest()
        return f"hf-{digest[:16]}"
