"""Training corpora of the project's own models: English prose, Python sources, generated arithmetic.

Every corpus yields fixed-length rows ``[BOS] + tokens`` in the ids of a tokenizer (bytes unless another is
given) and keeps a held-out part that training never sees, so that evaluation figures mean something.
"""
from __future__ import annotations

import logging
import random
import re
import sys
import sysconfig
import unicodedata
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, Sequence, TypeVar

import torch

from swarm.models.tokenizer import ByteTokenizer, Tokenizer
from swarm.train.config import BUILTIN_CORPORA
from swarm.train.prose import prose_sources

logger = logging.getLogger(__name__)

HELD_OUT_FRACTION = 0.05
T = TypeVar("T", bytes, str, torch.Tensor)


class Corpus(Protocol):
    """What training and evaluation draw rows from."""

    name: str
    tokenizer: Tokenizer  # the ids rows are made of

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


def held_out_split(data: T) -> tuple[T, T]:
    """(training part, held-out tail) of one source: its last :data:`HELD_OUT_FRACTION`."""
    cut = int(len(data) * (1 - HELD_OUT_FRACTION))
    return data[:cut], data[cut:]


class TextCorpus:
    """Token streams (training and held-out); rows are random windows of them, each starting with BOS.

    ``sources`` are held out separately, each losing its own tail, so that a small source still has
    held-out text and a large one does not hide the others'. With the byte tokenizer a token is a byte.
    """

    def __init__(self, sources: bytes | str | Sequence[bytes | str], name: str,
                 tokenizer: Optional[Tokenizer] = None):
        self.name = name
        self.tokenizer = tokenizer or ByteTokenizer()
        self.bos = self.tokenizer.bos_token_id
        sources = [sources] if isinstance(sources, (bytes, str)) else list(sources)
        splits = [held_out_split(source) for source in sources]
        self._train_parts: list[bytes | str] = [train for train, _ in splits]
        self._train_ids: Optional[torch.Tensor] = None
        self.held_out_ids = self._sized(self._encode([held for _, held in splits]), "held-out")
        logger.info("corpus %s: %d held-out tokens", name, len(self.held_out_ids))

    @property
    def train_ids(self) -> torch.Tensor:
        """The training tokens, encoded on first use: an evaluation reads only the held-out tails, and encoding the
        training text (the prose corpus: 2.8 MB through the subword tokenizer) was most of its time."""
        if self._train_ids is None:
            self._train_ids = self._sized(self._encode(self._train_parts), "training")
            self._train_parts = []
            logger.info("corpus %s: %d training tokens", self.name, len(self._train_ids))
        return self._train_ids

    def _sized(self, ids: torch.Tensor, part: str) -> torch.Tensor:
        if len(ids) < 64:
            raise ValueError(f"corpus {self.name!r} is too small ({len(ids)} {part} tokens; at least 64 needed)")
        return ids

    def _encode(self, parts: Sequence[bytes | str]) -> torch.Tensor:
        ids: list[int] = []
        for part in parts:
            if isinstance(self.tokenizer, ByteTokenizer):
                ids.extend(part if isinstance(part, bytes) else part.encode("utf-8"))
            else:
                ids.extend(self.tokenizer.encode(part.decode("utf-8", errors="ignore") if isinstance(part, bytes)
                                                 else part))
        return torch.tensor(ids, dtype=torch.long)

    def batch(self, size: int, seq_len: int, generator: torch.Generator, held_out: bool = False) -> torch.Tensor:
        source = self.held_out_ids if held_out else self.train_ids
        starts = torch.randint(0, len(source) - seq_len, (size,), generator=generator)
        rows = torch.stack([source[s: s + seq_len - 1] for s in starts.tolist()])
        return torch.cat([torch.full((size, 1), self.bos), rows], dim=1)

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
    # The one written form of a problem: operands without leading zeros, ASCII digits only (``int`` would also read
    # "０１２"). The held-out partition hashes this text, so a second spelling of a held-out problem must not pass.
    PROMPT = re.compile(r"(0|[1-9][0-9]*)\+(0|[1-9][0-9]*)=", re.ASCII)

    def __init__(self, max_digits: int = 3, tokenizer: Optional[Tokenizer] = None):
        self.max_digits = max_digits
        self.tokenizer = tokenizer or ByteTokenizer()
        (self.equals_id,) = self.tokenizer.encode("=")

    def _problem(self, rng: random.Random) -> Problem:
        a = rng.randrange(10 ** rng.randint(1, self.max_digits))
        b = rng.randrange(10 ** rng.randint(1, self.max_digits))
        return Problem(f"{a}+{b}=", str(a + b))

    def given_positions(self, rows: torch.Tensor) -> torch.Tensor:
        """BOS and the prompt (everything up to and including the first ``=``), and PAD."""
        equals = rows == self.equals_id
        return ((equals.long().cumsum(1) - equals.long()) == 0) | (rows == self.tokenizer.pad_token_id)

    @staticmethod
    def is_held_out(problem: Problem) -> bool:
        return zlib.crc32(problem.prompt.encode()) % 20 == 0

    def solve(self, a: int, b: int) -> str:
        """The one right answer to ``a+b=`` in this task's form."""
        return str(a + b)

    def operands(self, prompt: str) -> Optional[tuple[int, int]]:
        """``(a, b)`` of a prompt written exactly as this task writes one (``a+b=``, each of 1 to ``max_digits``
        digits); None for anything else."""
        match = self.PROMPT.fullmatch(prompt) if len(prompt) <= 2 * self.max_digits + 2 else None
        if match is None or max(len(match[1]), len(match[2])) > self.max_digits:
            return None
        return int(match[1]), int(match[2])

    def check(self, prompt: str, answer: str) -> bool:
        """True only when ``prompt`` is one of this task's problems and ``answer`` is its answer, character for
        character (the self-prompting loop keeps only what this accepts)."""
        operands = self.operands(prompt)
        return operands is not None and answer == self.solve(*operands)

    def normalise(self, prompt: str) -> Optional[str]:
        """The task's spelling of a text that *means* one of its problems (other digits, spaces, leading zeros:
        ``" ０12 + 5 ="`` is ``12+5=``), or None. The held-out guard reads data through this, so no respelling of a
        held-out problem gets past it."""
        text = "".join(unicodedata.normalize("NFKC", prompt[:64]).split())
        match = re.fullmatch(r"([0-9]+)\+([0-9]+)=", text, re.ASCII)
        if match is None:
            return None
        canonical = f"{int(match[1])}+{int(match[2])}="
        return canonical if self.operands(canonical) is not None else None

    def would_contaminate(self, prompt: str) -> bool:
        """Whether training on ``prompt`` would teach a held-out problem (in any spelling :meth:`normalise` reads)."""
        canonical = self.normalise(prompt)
        return canonical is not None and self.is_held_out(Problem(canonical, ""))

    def proposal_template(self, seed: Problem, rng: random.Random) -> str:
        """The start of a new problem built from a seed: its first operand with one digit changed, and ``+``. The
        model (or, where it writes nothing that parses, ``fill``) completes it."""
        operands = self.operands(seed.prompt)
        a = operands[0] if operands is not None else rng.randrange(10)
        digits = list(str(a))
        digits[rng.randrange(len(digits))] = str(rng.randrange(10))
        return f"{int(''.join(digits))}+"

    def parse_proposal(self, text: str) -> Optional[str]:
        """The problem a completed template names: its leading ``a+b=`` when written as this task writes problems
        (the answer the model may have gone on to write is ignored); None otherwise."""
        match = self.PROMPT.match(text[:2 * self.max_digits + 2])
        return match[0] if match is not None and self.operands(match[0]) is not None else None

    def fill(self, template: str, seed: Problem, rng: random.Random) -> str:
        """The template completed by chance: a second operand with as many digits as the seed's."""
        operands = self.operands(seed.prompt)
        width = len(str(operands[1])) if operands is not None else 1
        return f"{template}{rng.randrange(10 ** width)}="

    def problems(self, count: int, seed: int, held_out: bool) -> list[Problem]:
        rng, out = random.Random(seed), []
        while len(out) < count:
            problem = self._problem(rng)
            if self.is_held_out(problem) == held_out:
                out.append(problem)
        return out

    def batch(self, size: int, seq_len: int, generator: torch.Generator, held_out: bool = False) -> torch.Tensor:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        rows = encode_problems(self.problems(size, seed, held_out), seq_len, self.tokenizer)
        return end_at_random_lengths(rows, generator, self.tokenizer)


class TaggedAdditionTask(AdditionTask):
    """Addition answered in a house style the embedded models never write: the sum followed by ``!``
    (``12+5=`` -> ``17!``). The base models score 0 on it and an adapter learns it in a few hundred samples, which
    is what the self-improvement demonstration needs (docs/TRAINING.md): a curve a 2-core machine draws in minutes.
    The held-out problems are addition's."""

    name = "tagged-addition"
    TAG = "!"

    def problems(self, count: int, seed: int, held_out: bool) -> list[Problem]:
        plain = super().problems(count, seed, held_out)
        return [Problem(p.prompt, self.solve(*self.operands(p.prompt))) for p in plain]

    def solve(self, a: int, b: int) -> str:
        return f"{a + b}{self.TAG}"


class BracketedAdditionTask(TaggedAdditionTask):
    """Addition answered in a second house style, the sum in brackets (``12+5=`` -> ``[17]``): the second domain of the
    self-prompting demonstration (docs/TRAINING.md), with the same held-out problems as addition's."""

    name = "bracketed-addition"

    def solve(self, a: int, b: int) -> str:
        return f"[{a + b}]"


class DottedAdditionTask(TaggedAdditionTask):
    """Addition answered as a sentence ends, the sum then a full stop (``12+5=`` -> ``17.``): a second house style the
    embedded models never write and learn as readily as tagged addition's, because the sum stays where addition puts
    it and only a mark follows. Measured (``python benchmarks/seed_start.py``; docs/TRAINING.md, "The one-command
    demonstration"): 20 steps on 16 seeds answer 15 of 40 held-out problems, where bracketed addition's ``[17]``
    (every digit moved one place right) answers none after 40 steps and 2 after 160, too rarely for expert iteration
    to start from."""

    name = "dotted-addition"
    TAG = "."


class HostBlocksTask:
    """The network's own question as a domain: which blocks should a joining server host?

    A question is a health map in short, ``"21030112|3="``: how many servers hold each of the model's
    :data:`BLOCKS` blocks (0-9) and how many blocks the newcomer hosts; the answer is the first block of its span
    (``"2"``). The checker scores an answer by the coverage it gives: the best span is the one whose coverage after
    the newcomer joins, sorted weakest first, is largest (the weakest block as well served as it can be, then the
    next weakest, ...), then leftmost. The built-in rule (``swarm.server.block_selection.least_covered_window``)
    approximates it and is scored by the same checker (:meth:`rule`). Held-out questions: the same hash partition as
    addition's."""

    name = "host-blocks"
    BLOCKS = 8
    PROMPT = re.compile(r"([0-9]{8})\|([1-8])=", re.ASCII)

    def __init__(self, tokenizer: Optional[Tokenizer] = None):
        self.tokenizer = tokenizer or ByteTokenizer()

    def question(self, prompt: str) -> Optional[tuple[list[int], int]]:
        """(servers per block, span length) of a question written exactly as this task writes one; else None."""
        match = self.PROMPT.fullmatch(prompt) if len(prompt) <= self.BLOCKS + 3 else None
        return None if match is None else ([int(c) for c in match[1]], int(match[2]))

    @staticmethod
    def best(cover: Sequence[int], span: int) -> int:
        """The span start whose coverage after joining, sorted weakest first, is largest (then leftmost)."""
        def after(start: int) -> list[int]:
            return sorted(c + (start <= i < start + span) for i, c in enumerate(cover))

        return max(range(len(cover) - span + 1), key=lambda s: (after(s), -s))

    def rule(self, prompt: str) -> Optional[str]:
        """The built-in rule's answer to a question (the server's ``--num-blocks`` choice)."""
        from swarm.server.block_selection import least_covered_window

        question = self.question(prompt)
        return None if question is None else str(least_covered_window(*question))

    def check(self, prompt: str, answer: str) -> bool:
        question = self.question(prompt)
        return question is not None and answer == str(self.best(*question))

    def problems(self, count: int, seed: int, held_out: bool) -> list[Problem]:
        rng, out = random.Random(seed), []
        while len(out) < count:
            cover = [min(9, int(rng.expovariate(0.7))) for _ in range(self.BLOCKS)]
            span = rng.randint(1, self.BLOCKS)
            problem = Problem(f"{''.join(map(str, cover))}|{span}=", str(self.best(cover, span)))
            if AdditionTask.is_held_out(problem) == held_out:
                out.append(problem)
        return out

    def normalise(self, prompt: str) -> Optional[str]:
        text = "".join(unicodedata.normalize("NFKC", prompt[:64]).split())
        return text if self.question(text) is not None else None

    def proposal_template(self, seed: Problem, rng: random.Random) -> str:
        """A seed's health map with one block's count changed, and ``|``: the model (or ``fill``) adds the span."""
        question = self.question(seed.prompt)
        cover = question[0] if question is not None else [rng.randrange(4) for _ in range(self.BLOCKS)]
        cover[rng.randrange(self.BLOCKS)] = rng.randrange(10)
        return "".join(map(str, cover)) + "|"

    def parse_proposal(self, text: str) -> Optional[str]:
        match = self.PROMPT.match(text[:self.BLOCKS + 3])
        return None if match is None else match[0]

    def fill(self, template: str, seed: Problem, rng: random.Random) -> str:
        return f"{template}{rng.randint(1, self.BLOCKS)}="

    def would_contaminate(self, prompt: str) -> bool:
        canonical = self.normalise(prompt)
        return canonical is not None and AdditionTask.is_held_out(Problem(canonical, ""))


def encode_problems(problems: Sequence[Problem], seq_len: int, tokenizer: Optional[Tokenizer] = None) -> torch.Tensor:
    """``[BOS] prompt answer [EOS]…`` padded with EOS, as LLaDA's supervised data is."""
    tokenizer = tokenizer or ByteTokenizer()
    rows = torch.full((len(problems), seq_len), tokenizer.eos_token_id)
    for i, problem in enumerate(problems):
        ids = [tokenizer.bos_token_id] + tokenizer.encode(problem.prompt + problem.answer)
        rows[i, : min(len(ids), seq_len)] = torch.tensor(ids[:seq_len])
    return rows


def end_at_random_lengths(rows: torch.Tensor, generator: torch.Generator,
                          tokenizer: Optional[Tokenizer] = None) -> torch.Tensor:
    """PAD each row after a length drawn uniformly between its content plus one EOS and the full row."""
    tokenizer = tokenizer or ByteTokenizer()
    seq_len = rows.shape[1]
    is_eos = rows == tokenizer.eos_token_id
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((len(rows),), seq_len - 1))
    shortest = first_eos + 1
    lengths = shortest + (torch.rand(len(rows), generator=generator) * (seq_len - shortest + 1)).long()
    beyond = torch.arange(seq_len)[None, :] >= lengths[:, None]
    return rows.masked_fill(beyond, tokenizer.pad_token_id)


def padding_mask(rows: torch.Tensor, pad_id: int = ByteTokenizer.PAD) -> Optional[torch.Tensor]:
    """Attention mask (True for real tokens) when some rows end in PAD; None when none do."""
    real = rows != pad_id
    return None if bool(real.all()) else real


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


# Corpora that are also tasks with checkable answers (``python -m swarm.eval --task``), by their names in
# swarm/train/config.py (TASK_NAMES, which the commands' options offer).
TASKS = {"addition": AdditionTask, "tagged-addition": TaggedAdditionTask, "bracketed-addition": BracketedAdditionTask,
         "dotted-addition": DottedAdditionTask, "host-blocks": HostBlocksTask}


def load_corpus(name_or_files: str, files: Optional[Sequence[str]] = None,
                tokenizer: Optional[Tokenizer] = None) -> Corpus:
    """A built-in corpus by name, or the given text files (each holding out its own tail), in ``tokenizer``'s ids."""
    if files:
        return TextCorpus([Path(f).read_bytes() for f in files], "files", tokenizer)
    if name_or_files == "prose":
        return TextCorpus(prose_sources(), "prose", tokenizer)
    if name_or_files == "python":
        return TextCorpus(python_bytes(), "python", tokenizer)
    if name_or_files == "addition":
        return AdditionTask(tokenizer=tokenizer)
    raise ValueError(f"unknown corpus {name_or_files!r}; "
                     f"choose one of {', '.join(BUILTIN_CORPORA)} or pass --data FILE")
