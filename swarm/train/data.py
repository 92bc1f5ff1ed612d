"""Training corpora for the byte-level models: English prose, Python sources, generated arithmetic.

Every corpus yields fixed-length rows ``[BOS] + tokens`` and keeps a held-out part that training never
sees, so that evaluation figures mean something.
"""
from __future__ import annotations

import logging
import random
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, Sequence

import torch

from swarm.models.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)

HELD_OUT_FRACTION = 0.05
PROSE_FILES = (
    "lee_background.cor",
    "lee.cor",
    "crime-and-punishment.txt",
    "para2para_text1.txt",
    "para2para_text2.txt",
)


class Corpus(Protocol):
    """What training and evaluation draw rows from."""

    name: str

    def batch(self, size: int, seq_len: int, generator: torch.Generator, held_out: bool = False) -> torch.Tensor:
        """``size`` rows of ``seq_len`` token ids, each starting with BOS, from the training or held-out part."""
        ...

    def given_positions(self, rows: torch.Tensor) -> torch.Tensor:
        """Positions never masked and never scored: BOS, a task's prompt, PAD after a row's end."""
        ...


def bos_only(rows: torch.Tensor) -> torch.Tensor:
    given = torch.zeros_like(rows, dtype=torch.bool)
    given[:, 0] = True
    return given


class TextCorpus:
    """A long byte stream; rows are random windows of it, each starting with BOS."""

    def __init__(self, data: bytes, name: str):
        if len(data) < 1024:
            raise ValueError(f"corpus {name!r} is too small ({len(data)} bytes)")
        cut = int(len(data) * (1 - HELD_OUT_FRACTION))
        self.name = name
        self.train_bytes = torch.frombuffer(bytearray(data[:cut]), dtype=torch.uint8).long()
        self.held_out_bytes = torch.frombuffer(bytearray(data[cut:]), dtype=torch.uint8).long()

    def batch(self, size: int, seq_len: int, generator: torch.Generator, held_out: bool = False) -> torch.Tensor:
        source = self.held_out_bytes if held_out else self.train_bytes
        starts = torch.randint(0, len(source) - seq_len, (size,), generator=generator)
        rows = torch.stack([source[s: s + seq_len - 1] for s in starts.tolist()])
        return torch.cat([torch.full((size, 1), ByteTokenizer.BOS), rows], dim=1)

    def given_positions(self, rows: torch.Tensor) -> torch.Tensor:
        return bos_only(rows)


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class AdditionTask:
    """Multi-digit addition ``a+b=c``; problems whose hash falls in a fixed bucket are held out.

    Both a corpus (rows to train on) and a task (problems with one right answer, for exact match). As in
    LLaDA's supervised fine-tuning, the prompt ``a+b=`` is always given and only the answer and the EOS
    padding after it are masked: the model learns p(answer | prompt), which is what generation asks of it,
    instead of spending its capacity on guessing masked operands.

    Each row ends at a random length (then PAD, outside attention): rows that all end at ``seq_len``
    teach the model to place digits by their distance from the end of the sequence, and it then answers
    wrongly at any other length (measured: 13% exact match with 8 generated tokens against 35% when the
    sequence was filled out to the training length, same weights).
    """

    name = "addition"

    def __init__(self, max_digits: int = 3):
        self.max_digits = max_digits

    def _problem(self, rng: random.Random) -> Problem:
        a = rng.randrange(10 ** rng.randint(1, self.max_digits))
        b = rng.randrange(10 ** rng.randint(1, self.max_digits))
        return Problem(f"{a}+{b}=", str(a + b))

    @staticmethod
    def given_positions(rows: torch.Tensor) -> torch.Tensor:
        """BOS and the prompt (everything up to and including the first ``=``), and PAD."""
        equals = rows == ord("=")
        return ((equals.long().cumsum(1) - equals.long()) == 0) | (rows == ByteTokenizer.PAD)

    @staticmethod
    def is_held_out(problem: Problem) -> bool:
        return zlib.crc32(problem.prompt.encode()) % 20 == 0

    def problems(self, count: int, seed: int, held_out: bool) -> list[Problem]:
        rng, out = random.Random(seed), []
        while len(out) < count:
            problem = self._problem(rng)
            if self.is_held_out(problem) == held_out:
                out.append(problem)
        return out

    def batch(self, size: int, seq_len: int, generator: torch.Generator, held_out: bool = False) -> torch.Tensor:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        return end_at_random_lengths(encode_problems(self.problems(size, seed, held_out), seq_len), generator)


def encode_problems(problems: Sequence[Problem], seq_len: int) -> torch.Tensor:
    """``[BOS] prompt answer [EOS]…`` padded with EOS, as LLaDA's supervised data is."""
    rows = torch.full((len(problems), seq_len), ByteTokenizer.EOS)
    for i, problem in enumerate(problems):
        ids = [ByteTokenizer.BOS] + list((problem.prompt + problem.answer).encode())
        rows[i, : min(len(ids), seq_len)] = torch.tensor(ids[:seq_len])
    return rows


def end_at_random_lengths(rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """PAD each row after a length drawn uniformly between its content plus one EOS and the full row."""
    seq_len = rows.shape[1]
    is_eos = rows == ByteTokenizer.EOS
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((len(rows),), seq_len - 1))
    shortest = first_eos + 1
    lengths = shortest + (torch.rand(len(rows), generator=generator) * (seq_len - shortest + 1)).long()
    beyond = torch.arange(seq_len)[None, :] >= lengths[:, None]
    return rows.masked_fill(beyond, ByteTokenizer.PAD)


def padding_mask(rows: torch.Tensor) -> Optional[torch.Tensor]:
    """Attention mask (True for real tokens) when some rows end in PAD; None when none do."""
    real = rows != ByteTokenizer.PAD
    return None if bool(real.all()) else real


def prose_bytes() -> bytes:
    """English prose from gensim's test data (installed by the ``train`` extra)."""
    try:
        from gensim.test.utils import datapath
    except ImportError as error:
        raise RuntimeError("the prose corpus needs gensim: pip install -e .[train]") from error
    texts = [Path(datapath(name)).read_text(encoding="utf-8", errors="ignore") for name in PROSE_FILES]
    return "\n".join(" ".join(t.split()) for t in texts).encode("utf-8")


def python_bytes(limit: int = 4_000_000) -> bytes:
    """Python sources of the standard library on this machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parent.name or path.name.startswith("test"):
            continue
        text = path.read_bytes()
        chunks.append(text)
        total += len(text)
        if total >= limit:
            break
    logger.info("python corpus: %d files, %d bytes from %s (Python %s)",
                len(chunks), total, root, sys.version.split()[0])
    return b"\n".join(chunks)


BUILTIN_CORPORA = ("prose", "python", "addition")
# Corpora that are also tasks with checkable answers (``python -m swarm.eval --task``).
TASKS = {"addition": AdditionTask}


def load_corpus(name_or_files: str, files: Optional[Sequence[str]] = None) -> Corpus:
    """A built-in corpus by name, or the concatenation of the given text files."""
    if files:
        data = b"\n".join(Path(f).read_bytes() for f in files)
        return TextCorpus(data, "files")
    if name_or_files == "prose":
        return TextCorpus(prose_bytes(), "prose")
    if name_or_files == "python":
        return TextCorpus(python_bytes(), "python")
    if name_or_files == "addition":
        return AdditionTask()
    raise ValueError(f"unknown corpus {name_or_files!r}; "
                     f"choose one of {', '.join(BUILTIN_CORPORA)} or pass --data FILE")
