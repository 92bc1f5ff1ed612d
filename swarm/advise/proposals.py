"""The model's proposal: an adapter of the ``host-blocks`` task answers the question, and its audited score is what the
auditors the reader trusts measured of that exact content (``--score-adapters host-blocks``).

The adapter is ``best:host-blocks`` (the version those auditors scored best, chosen as a client's ``best:TASK`` is), a
published ``NAME[@AUTHOR][@VERSION]``, or a local folder. A published one is resolved on the swarm, where the answer is
generated too (the model's blocks served as for any client); a local folder with no swarm runs on the model here, and
has no audited score (no report is read). torch and hivemind are imported only here, after the command line is checked.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from swarm.adapters.versions import Reference
from swarm.advise.advice import Proposal, Question, Score, judge
from swarm.advise.config import DEFAULT_ADAPTER, NONE, TASK
from swarm.eval.config import TaskGeneration
from swarm.reports.records import BEST

if TYPE_CHECKING:
    from swarm.dht.config import NetworkConfig
    from swarm.reports.records import AuditBook

logger = logging.getLogger(__name__)

SETTINGS = {**asdict(TaskGeneration()), "seed": 0}  # greedy: the answers the auditors score


@dataclass(frozen=True)
class ModelSource:
    """Where the model's proposal comes from: the adapter, the base model, and the swarm (None: offline)."""

    adapter: str
    model: str
    network: Optional[NetworkConfig] = None
    prefix: Optional[str] = None
    auditors: tuple[str, ...] = ()


def is_folder(adapter: str) -> bool:
    """A path, as the client reads one (a name never holds '/')."""
    return Path(adapter).is_dir() or "/" in adapter


def check_adapter(adapter: str) -> None:
    """ValueError for an ``--adapter`` that can never answer this question (checked before any network starts)."""
    if adapter == NONE or adapter == DEFAULT_ADAPTER:
        return
    if adapter.startswith(BEST):
        raise ValueError(f"{adapter}: only {DEFAULT_ADAPTER} answers this question (an adapter of another "
                         "task does not)")
    if is_folder(adapter):
        if not Path(adapter).is_dir():
            raise ValueError(f"{adapter}: no such folder")
        return
    Reference.parse(adapter)  # AdapterError (a ValueError) saying what a reference is


def audited(book: Optional[AuditBook], sha256: str) -> Optional[Score]:
    """The latest trusted score of this content on the task, or None."""
    found = book.adapter_scores().get((sha256, TASK)) if book is not None and book.enabled else None
    if found is None:
        return None
    from swarm.cli.options import utc_time

    auditor, entry = found
    return Score(entry.correct, entry.examples, f"auditor {auditor[:12]}... ({utc_time(entry.checked)})")


def ask_model(question: Question, source: ModelSource) -> tuple[Optional[Proposal], Optional[str]]:
    """The model's proposal, or None and why there is none (one line)."""
    if source.adapter == NONE:
        return None, "--adapter none"
    if question.prompt is None:
        return None, f"the {TASK} task asks about models of 8 blocks, this one has {len(question.cover)}"
    if source.network is None:
        if not is_folder(source.adapter):
            return None, f"{source.adapter} is looked up on a swarm: give --initial-peers"
        return local_proposal(question, source), None
    return swarm_proposal(question, source)


def local_proposal(question: Question, source: ModelSource) -> Proposal:
    """A local adapter folder on the model run here: no report read, so no audited score."""
    from swarm.eval.tasks import task_answer
    from swarm.frontend.local import DiffusionLM

    lm = DiffusionLM.from_pretrained(source.model)
    answer = task_answer(lm, question.prompt, SETTINGS, {"adapter": source.adapter})
    return Proposal(source.adapter, answer, judge(question, answer), None)


def swarm_proposal(question: Question, source: ModelSource) -> tuple[Optional[Proposal], Optional[str]]:
    """The adapter resolved and run through the swarm as a client would, with its trusted audited score."""
    from swarm.adapters.sharing import content_hash, read_adapter_files
    from swarm.adapters.versions import resolve
    from swarm.client import DistributedDiffusionLM
    from swarm.client.config import ClientConfig
    from swarm.eval.tasks import task_answer
    from swarm.utils.errors import SwarmError

    config = ClientConfig(network=source.network, dht_prefix=source.prefix,
                          trusted_auditors=source.auditors or (NONE,))
    lm = DistributedDiffusionLM.from_pretrained(source.model, config=config)
    try:
        lm.planner.refresh_if_stale()  # the servers and the trusted reports, read once
        try:
            if source.adapter == DEFAULT_ADAPTER:
                reference = lm.best_adapter(TASK)
            else:
                reference = source.adapter
            sha256 = (content_hash(read_adapter_files(reference)) if is_folder(reference)
                      else resolve(lm.dht, lm.prefix, reference).sha256)
            answer = task_answer(lm, question.prompt, SETTINGS, {"adapter": reference})
        except SwarmError as error:  # no such adapter, no trusted score, no route: the rule is still the advice
            return None, " ".join(str(error).split())
        return Proposal(reference, answer, judge(question, answer), audited(lm.planner.audits, sha256)), None
    finally:
        lm.shutdown()
