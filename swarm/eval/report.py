"""One model's figures: held-out likelihood on a corpus and, for task models, exact-match accuracy.

Which data a model is judged on defaults to what it was trained on, read from the ``training.json``
written next to every checkpoint by ``python -m swarm.train``; a comparison model (the backbone) is then
judged on the same held-out text and problems: the same rows when the two share a tokenizer, otherwise
windows of the same held-out text in each model's own ids (compare them per byte, not per token).
"""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from swarm.eval.likelihood import LikelihoodReport, evaluate_likelihood
from swarm.eval.tasks import TaskGeneration, TaskReport, evaluate_task
from swarm.frontend.local import DiffusionLM
from swarm.models.loading import resolve_model_path
from swarm.train.data import BUILTIN_CORPORA, TASKS, load_corpus
from swarm.train.loop import TRAINING_INFO_FILE

logger = logging.getLogger(__name__)

FALLBACK_CORPUS = "prose"
FALLBACK_SEQ_LEN = 128


@dataclass(frozen=True)
class EvalPlan:
    """The data every model of one evaluation is scored on."""

    corpus: str  # a built-in corpus, or "files" with data_files
    seq_len: Optional[int]  # tokens per row; None: each model's training length
    task: Optional[str]
    examples: int
    data_files: tuple[str, ...] = ()
    seed: int = 0
    t_draws: int = 8
    batch_size: int = 64
    generation: TaskGeneration = TaskGeneration()
    adapter: Optional[str] = None  # applied to the first model only: the baseline shows what it changes

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data (the corpus by name), for JSON output."""
        return {"corpus": self.corpus, "data_files": list(self.data_files), "seq_len": self.seq_len,
                "task": self.task, "examples": self.examples, "adapter": self.adapter,
                "seed": self.seed, "t_draws": self.t_draws, "batch_size": self.batch_size,
                "generation": asdict(self.generation)}


@dataclass
class ModelReport:
    model: str  # the name or path as given
    path: str
    parameters: int
    layers: int
    hidden_size: int
    vocab_size: int
    likelihood: LikelihoodReport
    task: Optional[TaskReport]
    adapter: Optional[str] = None  # the adapter the figures were computed with

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def training_info(name_or_path: str | Path) -> dict[str, Any]:
    """The model's ``training.json`` (empty for checkpoints made elsewhere)."""
    path = resolve_model_path(name_or_path) / TRAINING_INFO_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def trained_on(name_or_path: str | Path) -> tuple[str, int]:
    """(built-in corpus, sequence length) the model was trained on, or the prose defaults when unknown."""
    settings = training_info(name_or_path).get("train_config", {})
    corpus = settings.get("corpus")
    if corpus not in BUILTIN_CORPORA or settings.get("data_files"):
        logger.info("%s has no built-in training corpus on record: evaluating on %s", name_or_path, FALLBACK_CORPUS)
        return FALLBACK_CORPUS, FALLBACK_SEQ_LEN
    return corpus, int(settings.get("seq_len", FALLBACK_SEQ_LEN))


def evaluate_model(name_or_path: str | Path, plan: EvalPlan, *, progress: bool = False,
                   corpora: Optional[dict[tuple, Any]] = None, adapter: Optional[str] = None) -> ModelReport:
    """One model's report, with ``adapter`` applied to every figure when given (a bad or foreign adapter is an
    ``AdapterError``); ``corpora`` caches the encoded corpus per tokenizer, so models that share a tokenizer
    (the backbone and its experts) build it once (extracting and encoding the prose takes seconds)."""
    lm = DiffusionLM.from_pretrained(name_or_path)
    lm.load_adapter(adapter)  # checked before any compute
    key = (plan.corpus, tuple(plan.data_files or ()), lm.tokenizer.fingerprint())
    corpora = {} if corpora is None else corpora
    if key not in corpora:
        corpora[key] = load_corpus(plan.corpus, plan.data_files, lm.tokenizer)
    corpus = corpora[key]
    likelihood = evaluate_likelihood(
        lm.model, corpus, examples=plan.examples, seq_len=plan.seq_len or trained_on(name_or_path)[1],
        t_draws=plan.t_draws, seed=plan.seed, batch_size=plan.batch_size, progress=progress,
        forward=functools.partial(lm.logits, adapter=adapter) if adapter else None,
    )
    task = None
    if plan.task is not None:
        task = evaluate_task(lm, TASKS[plan.task](tokenizer=lm.tokenizer), examples=plan.examples, seed=plan.seed,
                             generation=plan.generation, progress=progress,
                             generate_options={"adapter": adapter} if adapter else None)
    config = lm.config
    return ModelReport(
        model=str(name_or_path), path=str(lm.path), parameters=sum(p.numel() for p in lm.model.parameters()),
        layers=config.num_layers, hidden_size=config.hidden_size, vocab_size=config.vocab_size,
        likelihood=likelihood, task=task, adapter=adapter,
    )


def evaluate_models(models: Sequence[str | Path], plan: EvalPlan, *, progress: bool = False) -> list[ModelReport]:
    """Each model's report; ``plan.adapter`` applies to the first one (the others are its baselines)."""
    corpora: dict[tuple, Any] = {}
    return [evaluate_model(model, plan, progress=progress, corpora=corpora,
                           adapter=plan.adapter if index == 0 else None) for index, model in enumerate(models)]
