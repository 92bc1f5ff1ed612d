"""One trainer of the self-improving loop: rounds of training, its own held-out figure, a version when it is better.

A round: snapshot the data source (``swarm.improve.sources``), train ``round_steps`` more optimizer steps (together
with the run's other trainers when ``run_id`` is set), measure the held-out figure on the task's held-out problems
(the same ``held_out`` problems every round: a figure comparable between rounds, which auditors do not trust: they
draw fresh ones), and publish the adapter as the next version of ``name`` when the figure beats the last published
one by more than ``min_gain``. Everything the next round needs is on disk in ``workdir`` (the fine-tuning run's
state, ``improve.json``, the kept versions), so a trainer killed at any point resumes where it stood; at most
``keep`` versions stay on disk and on the swarm.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht import DHT

from swarm.adapters.sharing import FILES, author_id, publish, read_published
from swarm.adapters.versions import own_versions, publish_version
from swarm.dht.validation import ed25519_text
from swarm.eval.tasks import evaluate_task
from swarm.finetune.config import CollaborationConfig, FinetuneConfig
from swarm.finetune.data import load_examples
from swarm.finetune.trainer import Finetuner
from swarm.frontend.lm import BaseDiffusionLM
from swarm.improve.config import ImproveConfig
from swarm.improve.held_out import prompts_of, refuse_contaminated
from swarm.improve.hosting import VersionHost
from swarm.improve.self_prompt import SelfPromptConfig, SelfPrompter, SelfPromptRound
from swarm.improve.sources import DataSource, Snapshot
from swarm.train.data import TASKS

logger = logging.getLogger(__name__)

STATE_FILE = "improve.json"


@dataclass
class RoundResult:
    round: int
    steps: int  # the run's optimizer steps after the round
    loss: Optional[float]
    examples: int
    data: str  # sha256 of the data the round trained on
    figure: float  # the trainer's own held-out figure
    published_before: Optional[float]  # the figure of its last published version
    version: Optional[int]  # the version published this round (None: not better)
    seconds: float
    self_prompt: Optional[dict[str, Any]] = None  # the round's self-prompting record (SelfPromptRound.to_json)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def round_end(last_round_end: int, run_epoch: int, round_steps: int) -> int:
    """The optimizer step at which this round's training ends.

    A round ends ``round_steps`` after the last saved round ended, wherever the run stands: a trainer killed mid-round
    finishes that round's steps, and one killed after its training but before the round was saved (while it measured
    its figure) trains no more and measures again. Only a run already past that point (a collaboration went on while
    this trainer was away) trains a whole round from where it stands.
    """
    target = last_round_end + round_steps
    return target if run_epoch <= target else run_epoch + round_steps


class Improver:
    """The trainer role (see the module doc). ``host`` serves the published versions' files (None: something else
    serves them, e.g. a server with ``--serve-adapter``)."""

    def __init__(self, config: ImproveConfig, lm: BaseDiffusionLM, dht: DHT, key: Ed25519PrivateKey, prefix: str,
                 host: Optional[VersionHost]):
        config.validate()
        self.config, self.lm, self.dht, self.key, self.prefix, self.host = config, lm, dht, key, prefix, host
        self.workdir = Path(config.workdir)
        (self.workdir / "versions").mkdir(parents=True, exist_ok=True)
        self.source = DataSource(config.data)
        self.task = TASKS[config.task]()
        self.state = self._load_state()
        self.finetuner: Optional[Finetuner] = None
        self.prompter = None
        if config.self_prompt:
            self.prompter = SelfPrompter(self.task, Path(config.data), self.workdir / "self_prompt.json",
                                         SelfPromptConfig(proposals=config.self_prompt, seed=config.seed))
        for directory in self.kept():  # a restarted trainer serves what it kept again
            if host is not None:
                host.serve(directory)

    # ----- state on disk ---------------------------------------------------------------------------------
    def _load_state(self) -> dict[str, Any]:
        path = self.workdir / STATE_FILE
        if path.is_file():
            state = json.loads(path.read_text())
            logger.info("resuming %s at round %d", self.workdir, state["round"])
            return state
        return {"round": 0, "history": []}

    def _save_state(self) -> None:
        temporary = self.workdir / (STATE_FILE + ".tmp")
        temporary.write_text(json.dumps(self.state, indent=1))
        os.replace(temporary, self.workdir / STATE_FILE)

    def kept(self) -> list[Path]:
        """The version directories on disk, oldest first."""
        found = [p for p in (self.workdir / "versions").iterdir() if p.is_dir() and p.name.isdigit()]
        return sorted(found, key=lambda p: int(p.name))

    # ----- one round ---------------------------------------------------------------------------------------
    def _trainer(self, snapshot: Snapshot) -> Finetuner:
        config = self.config
        if self.finetuner is None:
            collaboration = None
            if config.run_id:
                collaboration = CollaborationConfig(config.run_id, config.target_batch_size or config.batch_size)
            finetune = FinetuneConfig(
                data=str(snapshot.path), output=str(self.workdir / "adapter"), steps=config.round_steps,
                lr=config.lr, batch_size=config.batch_size, adapter_kind=config.adapter_kind, rank=config.rank,
                head_rank=config.head_rank, pad_response=config.pad_response, seed=config.seed,
                save_every=max(1, config.round_steps // 2), growing_data=True, collaboration=collaboration)
            self.finetuner = Finetuner(self.lm, finetune, dht=self.dht if collaboration else None)
        else:
            trainer = self.finetuner
            trainer.examples = load_examples(snapshot.path, self.lm.tokenizer, trainer._eos())
            trainer.config.data_sha256 = snapshot.sha256
        self.finetuner.config.steps = round_end(self.state.get("steps", 0), self.finetuner.state.epoch,
                                                config.round_steps)
        return self.finetuner

    def figure(self, directory: Path) -> float:
        """The trainer's own held-out figure of the adapter in ``directory``."""
        report = evaluate_task(self.lm, self.task, examples=self.config.held_out, seed=self.config.eval_seed,
                               generate_options={"adapter": str(directory)})
        return report.correct / report.examples

    def published_figure(self) -> Optional[float]:
        """The own figure of this publisher's newest live version of the name (as the swarm holds it)."""
        latest = own_versions(self.dht, self.prefix, self.config.name, ed25519_text(self.key)).latest
        if latest is not None:
            return latest.score
        published = [entry for entry in self.state["history"] if entry.get("version")]
        return published[-1]["figure"] if published else None

    def base_figure(self) -> float:
        """The base model's figure without an adapter (measured once): a first version must beat it."""
        if "base_figure" not in self.state:
            report = evaluate_task(self.lm, self.task, examples=self.config.held_out, seed=self.config.eval_seed)
            self.state["base_figure"] = report.correct / report.examples
            self._save_state()
            logger.info("the base model's own held-out figure: %.3f", self.state["base_figure"])
        return self.state["base_figure"]

    def run_round(self) -> Optional[RoundResult]:
        """One round; None when the source holds no example yet (or, with ``min_new_examples``, not enough new
        ones)."""
        started = time.perf_counter()
        prompted = self.self_prompt()
        snapshot = self.source.snapshot(self.workdir / "data.jsonl")
        refuse_contaminated(self.task, prompts_of(snapshot.path), f"--data {self.source.describe()}")
        wanted = self.state.get("examples", 0) + max(1, self.config.min_new_examples)
        if snapshot.examples < wanted and not (self.config.min_new_examples == 0 and snapshot.examples):
            logger.debug("round %d waits: %s holds %d examples, %d wanted", self.state["round"] + 1,
                         self.source.describe(), snapshot.examples, wanted)
            return None
        trainer = self._trainer(snapshot)
        trainer.run(progress=False)
        adapter = self.workdir / "adapter"
        figure = self.figure(adapter)
        before = self.published_figure()
        version = None
        if figure > (self.base_figure() if before is None else before) + self.config.min_gain:
            version = self.publish(adapter, snapshot, figure)
        self.state["round"] += 1
        self.state["examples"], self.state["steps"] = snapshot.examples, trainer.state.epoch
        result = RoundResult(self.state["round"], trainer.state.epoch, trainer.smoothed_loss(), snapshot.examples,
                             snapshot.sha256, figure, before, version, time.perf_counter() - started,
                             prompted.to_json() if prompted is not None else None)
        self.state["history"] = (self.state["history"] + [result.to_json()])[-1000:]
        self._save_state()
        self.report_progress(result)
        logger.info("round %d: %d steps, loss %s, %d examples (data %s), own held-out figure %.3f (published %s): %s",
                    result.round, result.steps, result.loss, result.examples, result.data[:12], figure,
                    "-" if before is None else f"{before:.3f}",
                    f"published version {version}" if version else "not better, nothing published")
        return result

    def self_prompt(self) -> Optional[SelfPromptRound]:
        """With ``self_prompt``, a round of self-prompting before every round but the first (which trains on the seeds
        alone), answering with the adapter trained so far; it adds the accepted answers to the data folder. Its record
        (None: none this round, or a trainer killed after prompting resumes: that round's answers are on disk)."""
        if self.prompter is None or self.prompter.state["round"] >= self.state["round"]:
            return None
        return self.prompter.run_round(self.lm, str(self.workdir / "adapter"))

    def publish(self, adapter: Path, snapshot: Snapshot, figure: float) -> Optional[int]:
        """Copy the adapter's files into a version directory, serve them, publish the version; drop old versions."""
        staging = self.workdir / "versions" / "staging"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        for name in FILES:
            shutil.copy2(adapter / name, staging / name)
        sha = self.host.serve(staging) if self.host is not None else None
        served = [str(self.dht.peer_id)] if self.host is not None else []
        try:
            _, version = publish_version(self.dht, self.key, self.prefix, staging, self.config.name, snapshot.sha256,
                                         figure, served, keep=self.config.keep)
        except ValueError as error:  # AdapterError: e.g. the same content as a listed version
            logger.warning("not published: %s", error)
            if sha is not None:
                self.host.drop(sha)
            return None
        target = self.workdir / "versions" / str(version.number)
        shutil.rmtree(target, ignore_errors=True)
        staging.replace(target)
        for old in self.kept()[:-self.config.keep]:  # bounded disk: the newest `keep` versions stay
            if self.host is not None:
                self.host.drop(_sha_of(old))
            shutil.rmtree(old, ignore_errors=True)
        return version.number

    def report_progress(self, result: RoundResult) -> None:
        """Put the round's figures in the name record (the health map and the web map show them); refresh hosting."""
        if self.host is not None:
            self.host.announce()
        own = ed25519_text(self.key)
        head = next((r for r in read_published(self.dht, self.prefix, self.config.name, [author_id(own)])
                     if r.author == own), None)
        if head is None:
            return
        progress = {"round": result.round, "steps": result.steps, "loss": result.loss, "figure": result.figure,
                    "examples": result.examples}
        training = {**{k: v for k, v in head.training.items() if k not in progress}, **progress}
        try:
            publish(self.dht, self.key, self.prefix, dataclasses.replace(head, training=dict(list(training.items())
                                                                                              [-32:])))
        except ValueError as error:
            logger.warning("could not refresh the name record's progress: %s", error)

    def run(self) -> list[RoundResult]:
        """``rounds`` rounds (0: until interrupted); the results."""
        results = []
        while not self.config.rounds or self.state["round"] < self.config.rounds:
            result = self.run_round()
            if result is None:
                time.sleep(self.config.poll)  # nothing (new) to train on: look again
                continue
            results.append(result)
        return results

    def close(self, close_host: bool = True) -> None:
        if self.finetuner is not None:
            self.finetuner.close()
        if self.host is not None and close_host:
            self.host.close()


def _sha_of(directory: Path) -> str:
    from swarm.adapters.sharing import content_hash, read_adapter_files

    return content_hash(read_adapter_files(directory))
