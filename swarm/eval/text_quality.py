"""``python -m swarm.eval.text_quality``: how readable a model's generated prose (or code) is.

Prose: two figures over completions of a fixed set of prompts: the share of generated words found in a
dictionary (Debian's ``wamerican`` list by default) and the repeated word 3-grams (a 3-gram seen earlier in
the same completion counts once per repeat). Neither says the text makes sense, but a model that writes
non-words or loops on one phrase scores badly on them, which is what they are for: comparing two models, or
two sampler settings of one model, on exactly the same prompts.

Code (``--kind code``): the share of completions of Python prompts that are *code-shaped*: not blank, with a
word that marks Python and is rare in prose (``def``, ``return``, ``self``, ``None``...), brackets balanced.
"""
from __future__ import annotations

import itertools
import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

import click

from swarm.cli.options import SwarmCommand, apply_threads, gen_length_option, run_main, setup_logging, threads_option
from swarm.diffusion.config import MAX_TEMPERATURE
from swarm.diffusion.remasking import STRATEGIES
from swarm.models.config import DEFAULT_MODEL

if TYPE_CHECKING:  # the model code (torch) loads after the arguments are parsed
    from swarm.frontend.lm import BaseDiffusionLM

logger = logging.getLogger(__name__)

DEFAULT_DICTIONARY = "/usr/share/dict/american-english"
PROMPTS = (
    "The government said",
    "In the morning",
    "He was born in",
    "The city of",
    "She looked at the",
    "After the war",
    "Scientists have found that",
    "The history of the",
)
CODE_PROMPTS = (
    "def f(x):",
    "import os\n",
    "class Stack:",
    "for i in range(10):",
    "def read_file(path):",
    "if __name__ == \"__main__\":",
    "with open(path) as f:",
    "def __init__(self, name):",
)
# Words that mark Python and are rare in English prose ("in", "for", "is", "and"... are both, so they do not count).
PYTHON_MARKERS = frozenset(
    "def return import class self elif None True False lambda yield except isinstance len print __init__ "
    "__name__ kwargs args".split()
)
_IDENTIFIER = re.compile(r"[A-Za-z_]+")
_CLOSING = {")": "(", "]": "[", "}": "{"}
SWEEP_TEMPERATURES = (0.0, 0.5, 1.0)
SWEEP_SEEDS = (0, 1)
_WORD = re.compile(r"[A-Za-z]+")


def load_dictionary(path: str | Path = DEFAULT_DICTIONARY) -> frozenset[str]:
    """Lower-cased words of a one-word-per-line list (possessive ``'s`` entries folded into their word)."""
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="ignore").split()
    except FileNotFoundError:
        raise FileNotFoundError(f"no word list at {path}: install Debian's wamerican, or give --dictionary") from None
    return frozenset(word.lower().removesuffix("'s") for word in lines)


def words(text: str) -> list[str]:
    return [word.lower() for word in _WORD.findall(text)]


def repeated_trigrams(text: str) -> tuple[int, int]:
    """(3-grams that repeat an earlier one of the same text, all 3-grams) of the text's words."""
    seq = words(text)
    grams = list(zip(seq, seq[1:], seq[2:]))
    return len(grams) - len(set(grams)), len(grams)


def balanced_brackets(text: str) -> bool:
    stack: list[str] = []
    for char in text:
        if char in "([{":
            stack.append(char)
        elif char in _CLOSING and (not stack or stack.pop() != _CLOSING[char]):
            return False
    return not stack


def is_code_shaped(text: str) -> bool:
    """Not blank, at least one word that marks Python, brackets balanced: the least a code completion should be."""
    return bool(text.strip()) and bool(PYTHON_MARKERS & set(_IDENTIFIER.findall(text))) and balanced_brackets(text)


@dataclass
class TextQuality:
    """The figures of one model with one set of sampler settings over every prompt (and seed)."""

    settings: dict[str, Any]
    words: int = 0
    dictionary_words: int = 0
    trigrams: int = 0
    repeated_trigrams: int = 0
    completions: int = 0
    code_shaped: int = 0
    elapsed_s: float = 0.0
    samples: list[dict[str, str]] = field(default_factory=list)

    @property
    def dictionary_share(self) -> float:
        return self.dictionary_words / max(1, self.words)

    @property
    def repeated_share(self) -> float:
        return self.repeated_trigrams / max(1, self.trigrams)

    @property
    def code_shaped_share(self) -> float:
        return self.code_shaped / max(1, self.completions)

    def add(self, prompt: str, text: str, dictionary: frozenset[str]) -> None:
        found = words(text)
        self.words += len(found)
        self.dictionary_words += sum(word in dictionary for word in found)
        repeats, grams = repeated_trigrams(text)
        self.repeated_trigrams += repeats
        self.trigrams += grams
        self.completions += 1
        self.code_shaped += is_code_shaped(text)
        self.samples.append({"prompt": prompt, "text": text})

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "dictionary_share": round(self.dictionary_share, 4),
                "repeated_share": round(self.repeated_share, 4), "code_shaped_share": round(self.code_shaped_share, 4)}


def measure(lm: BaseDiffusionLM, dictionary: frozenset[str], settings: dict[str, Any],
            prompts: Sequence[str] = PROMPTS, seeds: Iterable[int] = (0,)) -> TextQuality:
    """Complete every prompt with ``settings`` (once per seed) and score the generated text only."""
    quality, started = TextQuality(dict(settings)), time.perf_counter()
    for seed, prompt in itertools.product(seeds, prompts):
        result = lm.generate(prompt, seed=seed, **settings)
        quality.add(prompt, result.text, dictionary)
    quality.elapsed_s = round(time.perf_counter() - started, 2)
    return quality


def parse_experts(text: str) -> str | dict[str, float]:
    """``auto`` or ``code=1,addition=0.5`` as ``generate(experts=...)`` takes it."""
    if text == "auto":
        return text
    try:
        return {name: float(weight) for name, weight in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise click.BadParameter(f"expected 'auto' or NAME=WEIGHT[,NAME=WEIGHT], got {text!r}") from None


def sweep_settings(base: dict[str, Any]) -> list[dict[str, Any]]:
    """Every remasking strategy at each sweep temperature, on top of ``base``."""
    return [{**base, "remasking": strategy, "temperature": temperature}
            for strategy in STRATEGIES for temperature in SWEEP_TEMPERATURES]


def describe(quality: TextQuality, kind: str = "prose") -> str:
    shown = ", ".join(f"{k}={v}" for k, v in quality.settings.items())
    if kind == "code":
        return (f"{shown}: {quality.code_shaped}/{quality.completions} code-shaped completions "
                f"({quality.code_shaped_share:.0%}), {quality.elapsed_s:.1f} s")
    return (f"{shown}: {quality.dictionary_share:.1%} dictionary words ({quality.dictionary_words}/{quality.words}), "
            f"{quality.repeated_trigrams}/{quality.trigrams} repeated 3-grams ({quality.repeated_share:.1%}), "
            f"{quality.elapsed_s:.1f} s")


@click.command(cls=SwarmCommand, context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--model", default=DEFAULT_MODEL, help="Embedded model name or checkpoint directory.")
@click.option("--dictionary", default=DEFAULT_DICTIONARY, type=click.Path(dir_okay=False),
              help="Word list, one word per line (Debian's wamerican).")
@gen_length_option(type=click.IntRange(min=1), default=64,
              help="Tokens generated per prompt (a byte model needs about 3.4 times more for the same text).")
@click.option("--block-length", type=click.IntRange(min=1), default=None,
              help="Sampler block length [default: generate's].")
@click.option("--remasking", type=click.Choice(STRATEGIES), default=None,
              help="Remasking strategy [default: the model's own default, else generate's].")
@click.option("--temperature", type=click.FloatRange(0, MAX_TEMPERATURE), default=None,
              help="Sampling temperature [default: the model's own default, else greedy].")
@click.option("--kind", type=click.Choice(["prose", "code"]), default="prose",
              help="Prose prompts (dictionary words, repeats) or Python prompts (code-shaped completions).")
@click.option("--experts", default=None,
              help="Compose experts with the model: 'auto', or NAME=WEIGHT[,NAME=WEIGHT] (e.g. code=1).")
@click.option("--expert-top-k", type=click.IntRange(min=0), default=None,
              help="With --experts: tokens per position each expert answers (0: the whole vocabulary) "
                   "[default: generate's].")
@click.option("--sweep", is_flag=True,
              help=f"Try every remasking strategy at temperatures {', '.join(map(str, SWEEP_TEMPERATURES))} "
                   f"(seeds {', '.join(map(str, SWEEP_SEEDS))} each) instead of one setting.")
@click.option("--seeds", type=click.IntRange(min=1), default=1,
              help="Complete every prompt once per seed 0..N-1 (more completions, a steadier share).")
@click.option("--samples", type=click.IntRange(min=0), default=4, help="Completions to print per setting.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@threads_option()
def main(model: str, dictionary: str, gen_length: int, block_length: Optional[int], remasking: Optional[str],
         temperature: Optional[float], kind: str, experts: Optional[str], expert_top_k: Optional[int], sweep: bool,
         seeds: int, samples: int, as_json: bool, threads: Optional[int]) -> None:
    """Generate from fixed prompts and report the share of dictionary words and the repeated word 3-grams."""
    from swarm.frontend.local import DiffusionLM

    setup_logging(logging.WARNING)
    apply_threads(threads)
    words_known = load_dictionary(dictionary)
    lm = DiffusionLM.from_pretrained(model)
    base = {"gen_length": gen_length, **({"block_length": block_length} if block_length else {})}
    if experts:
        base["experts"] = parse_experts(experts)
        if expert_top_k is not None:
            base["expert_top_k"] = expert_top_k
    given = {k: v for k, v in (("remasking", remasking), ("temperature", temperature)) if v is not None}
    prompts = CODE_PROMPTS if kind == "code" else PROMPTS
    if sweep:
        runs = [measure(lm, words_known, s, prompts, seeds=SWEEP_SEEDS) for s in sweep_settings(base)]
    else:
        runs = [measure(lm, words_known, {**base, **given}, prompts, seeds=range(seeds))]
    if as_json:
        click.echo(json.dumps({"model": model, "kind": kind, "sampling_defaults": dict(lm.sampling_defaults),
                               "prompts": list(prompts), "runs": [r.to_dict() for r in runs]}, indent=2))
        return
    click.echo(f"{model} (model defaults: {dict(lm.sampling_defaults) or 'none'}), {len(prompts)} {kind} prompts")
    for run in runs:
        click.echo(describe(run, kind))
        for sample in run.samples[:samples]:
            click.echo(f"    {sample['prompt']!r} -> {sample['text']!r}")


if __name__ == "__main__":
    run_main(main)
