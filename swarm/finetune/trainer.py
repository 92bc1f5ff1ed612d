"""Training an adapter with the masked-diffusion SFT objective, on the local model or through the swarm.

The frozen model is seen as three differentiable pieces (:class:`swarm.frontend.lm.Backbone`, from the model's own
``backbone()``): the embedding (no gradient needed), the blocks (a function of the hidden states and, for a
per-block adapter, of its weights), and the head (with the adapter's head correction, when it has one). Locally the
blocks are the in-memory span; through the swarm they are one :class:`swarm.client.backbone.SwarmBlocks` call,
whose forward is the client's ordinary pass (recording each hop's input) and whose backward asks each hop's server
for the gradient of its input and of its blocks' slice of the adapter. Only the adapter's tensors are trained.

A run is a deterministic function of its :class:`FinetuneConfig` and data: batches and masking noise come from
one seeded generator saved with the optimiser, so an interrupted run resumes exactly where it stopped; its
settings must stay the same, except the learning rate of the steps still to come (:func:`schedule_differences`),
so a run can be annealed where it stands. With a
:class:`~swarm.finetune.config.CollaborationConfig` the optimiser is a ``hivemind.Optimizer`` shared by every
process of the run (``swarm/finetune/together.py``): a run's steps are then the collaboration's global steps.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import hivemind
import torch
from hivemind.dht import DHT
from torch import nn
from tqdm.auto import tqdm

from swarm.adapters.adapter import ADAPTER_CONFIG, PromptAdapter, base_of, new_adapter, size_setting
from swarm.adapters.kinds import RANKED_KINDS
from swarm.finetune.config import RUN_DEFINING, FinetuneConfig, lr_at, only_relevant, saved_settings
from swarm.finetune.data import Example, SFTBatch, data_digest, load_examples, make_batch
from swarm.finetune.together import (
    collaborative_optimizer,
    idle,
    peer_seed,
    peers_in_run,
    wait_for_peers,
)
from swarm.frontend.lm import Backbone, BaseDiffusionLM
from swarm.train.objective import mask_tokens, masked_cross_entropy

logger = logging.getLogger(__name__)

STATE_FILE = "finetune_state.pt"
def set_lr(optimizer: Any, lr: float) -> None:
    """Set the learning rate of every group (a ``hivemind.Optimizer`` hands out copies of its inner Adam's groups)."""
    inner = optimizer.state_averager.optimizer if isinstance(optimizer, hivemind.Optimizer) else optimizer
    for group in inner.param_groups:
        group["lr"] = lr


def schedule_differences(saved: dict[str, Any], config: FinetuneConfig, steps_taken: int) -> list[str]:
    """Where the learning rates of the steps a saved run has taken differ from ``config``'s: the schedule may
    change only for the steps still to come (e.g. to anneal a run from where it stands)."""
    saved_from = saved.get("lr_from") or ()
    changes = {0} | {int(step) for step, _ in (*saved_from, *config.lr_from) if int(step) < steps_taken}
    differences = []
    for step in sorted(changes):
        before, after = lr_at(saved["lr"], saved_from, step), config.lr_at(step)
        if before != after:
            differences.append(f"{'lr' if step == 0 else f'lr at step {step}'}: {before!r} -> {after!r}")
    return differences


def saved_run_defining(saved: dict[str, Any]) -> dict[str, Any]:
    """:meth:`FinetuneConfig.run_defining` of a saved run (runs saved before collaborations trained alone)."""
    collaboration = saved.get("collaboration") or {}
    saved = saved_settings(saved)
    return only_relevant({**{key: saved.get(key) for key in RUN_DEFINING}, "run_id": collaboration.get("run_id", ""),
                          "target_batch_size": collaboration.get("target_batch_size", saved.get("batch_size"))})


def adapted_logits(backbone: Backbone, adapter: PromptAdapter, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of ``tokens`` with the adapter's positions in front, differentiable with respect to its vectors."""
    with torch.no_grad():
        hidden = backbone.embed(tokens)
    blocks = backbone.blocks(adapter.extend(hidden), adapter.block_adapter)
    return backbone.head(adapter.strip(blocks), adapter.head_lora).float()


def sft_loss(backbone: Backbone, adapter: PromptAdapter, batch: SFTBatch, generator: torch.Generator) -> torch.Tensor:
    """LLaDA's SFT loss: the prompt stays clean, the response (and its EOS padding) is masked with ratio
    t ~ U(eps, 1]; cross-entropy on the masked positions weighted by 1/t, per row over its response length."""
    mask_id = backbone.config.mask_token_id
    noisy, masked, t = mask_tokens(batch.tokens, mask_id, generator, given=batch.given)
    logits = adapted_logits(backbone, adapter, noisy)
    per_token = masked_cross_entropy(logits, batch.tokens, masked, t)
    return (per_token.sum(1) / batch.answer_lengths).mean()


@dataclass
class StepReport:
    step: int  # this process's steps
    loss: float
    seconds: float
    epoch: int = 0  # the run's optimizer steps (the collaboration's, in a collaboration)
    peers: int = 1  # peers of the collaboration counted at this step


@dataclass
class FinetuneState:
    """What a resumed run needs besides the adapter: the step, the generator, the optimiser, the losses."""

    step: int = 0  # this process's steps (batches it computed)
    losses: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    epoch: int = 0  # optimizer steps of the run: equal to ``step`` alone, the global steps in a collaboration
    epochs: list[int] = field(default_factory=list)  # the epoch each loss was computed at
    peers: list[int] = field(default_factory=list)  # peers counted at each step


class Finetuner:
    """One run: load or resume the adapter in ``config.output``, train it, save it every ``save_every`` steps.

    With ``config.collaboration`` (and the ``dht`` to meet the other peers on) it trains together with them.
    """

    def __init__(self, lm: BaseDiffusionLM, config: FinetuneConfig,
                 optimizer_factory: Optional[Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = None,
                 dht: Optional[DHT] = None):
        if config.collaboration is not None and dht is None:
            raise ValueError("a collaboration needs a DHT peer to meet the others on")
        self.lm, self.config = lm, config
        self.examples: list[Example] = load_examples(config.data, lm.tokenizer, self._eos())
        config.data_sha256 = data_digest(config.data)
        self.output = Path(config.output)
        saved = self._saved()
        config.fill_defaults(saved["config"] if saved is not None else None)
        self.backbone = lm.backbone()
        self.generator = torch.Generator().manual_seed(config.seed)
        self.state = FinetuneState()
        self.adapter = self._start_adapter()  # every peer of a run starts from the same vectors (one --seed)
        params = list(self.adapter.parameters())  # the main tensor, and the head correction's when there is one
        if config.collaboration is not None:
            self.generator.manual_seed(peer_seed(config.seed, str(dht.peer_id)))
            self.optimizer = collaborative_optimizer(dht, config.collaboration, params, config.lr, config.batch_size)
        elif optimizer_factory is not None:
            self.optimizer = optimizer_factory(params)
        else:
            self.optimizer = torch.optim.Adam(params, lr=config.lr)
        self._joined = False  # set once this process has met the run's other peers (wait_for_peers)
        self._idle = contextlib.ExitStack()  # a collaboration's progress tracker, paused between runs (together.idle)
        if saved is not None:
            self._resume(saved)

    @property
    def collaborative(self) -> bool:
        return self.config.collaboration is not None

    def close(self) -> None:
        """Leave the collaboration (its averagers and progress tracker run in background processes)."""
        self._idle.close()
        if self.collaborative:
            self.optimizer.shutdown()

    def _eos(self) -> int:
        eos = self.lm.config.eos_token_id
        return eos if eos is not None else self.lm.tokenizer.eos_token_id

    def _start_adapter(self) -> PromptAdapter:
        base = base_of(self.lm.config, self.lm.tokenizer)
        if (self.output / ADAPTER_CONFIG).is_file():
            adapter = PromptAdapter.load(self.output, base)
            if adapter.config.head_rank != self.config.head_rank:
                raise ValueError(f"{self.output} holds an adapter with a head correction of rank "
                                 f"{adapter.config.head_rank}, not --head-rank {self.config.head_rank}")
            if adapter.config.size != self.adapter_size or adapter.kind != self.config.adapter_kind:
                size = f"rank {adapter.config.size}" if adapter.kind in RANKED_KINDS else f"{adapter.length} vectors"
                asked = "--" + size_setting(self.config.adapter_kind).replace("_", "-")
                raise ValueError(f"{self.output} holds a {adapter.kind} adapter of {size}, not --adapter-kind "
                                 f"{self.config.adapter_kind} {asked} {self.adapter_size}")
            return adapter
        return new_adapter(self.config.adapter_kind, self.adapter_size, self.lm.config, base,
                           self.backbone.embed, self.generator, self.config.head_rank, self.config.down_scale)

    @property
    def adapter_size(self) -> int:
        """The size the run asks for: a bottleneck's rank, a prompt's vectors."""
        return getattr(self.config, size_setting(self.config.adapter_kind))

    def _saved(self) -> Optional[dict[str, Any]]:
        """The state of the run in ``output`` (None for a new run)."""
        path = self.output / STATE_FILE
        return torch.load(path, weights_only=False) if path.is_file() else None

    def _resume(self, saved: dict[str, Any]) -> None:
        before = saved_run_defining(saved["config"])
        differ = [f"{key}: {before.get(key)!r} -> {value!r}" for key, value in self.config.run_defining().items()
                  if before.get(key) != value]
        taken = saved["state"].get("epoch", 0) if self.collaborative else saved["state"]["step"]
        differ += schedule_differences(saved["config"], self.config, taken)
        if differ:
            raise ValueError(f"{self.output} holds a run with other settings ({'; '.join(differ)}): resume it with "
                             f"the same ones or choose another --output")
        self.state = FinetuneState(**saved["state"])
        if not self.collaborative:
            self.state.epoch = self.state.step  # alone, every step is an optimizer step
        self.generator.set_state(saved["generator"])
        self.optimizer.load_state_dict(saved["optimizer"])
        logger.info("resuming %s at step %d", self.output, self.state.step)

    def save(self) -> None:
        """The adapter and the run's state, each replaced whole."""
        training = {"steps": self.state.epoch, "loss": self.smoothed_loss(), "lr": self.config.lr,
                    "lr_from": [list(change) for change in self.config.lr_from],
                    "down_scale": self.config.down_scale, "max_grad_norm": self.config.max_grad_norm,
                    "batch_size": self.config.batch_size,
                    "data_sha256": self.config.data_sha256,
                    "examples": len(self.examples), "wall_s": round(self.state.wall_s, 1),
                    "through_swarm": self.backbone.through_swarm}
        if self.collaborative:
            training.update(run_id=self.config.collaboration.run_id, local_steps=self.state.step,
                            target_batch_size=self.config.collaboration.target_batch_size,
                            max_peers=max(self.state.peers, default=1))
        self.adapter.save(self.output, training)
        state = {"config": asdict(self.config), "state": asdict(self.state), "generator": self.generator.get_state(),
                 "optimizer": self.optimizer.state_dict()}
        temporary = self.output / (STATE_FILE + ".tmp")
        torch.save(state, temporary)
        temporary.replace(self.output / STATE_FILE)

    def smoothed_loss(self, last: int = 10) -> Optional[float]:
        recent = self.state.losses[-last:]
        return round(sum(recent) / len(recent), 4) if recent else None

    def next_batch(self) -> SFTBatch:
        rows = torch.randint(len(self.examples), (self.config.batch_size,), generator=self.generator)
        return make_batch([self.examples[i] for i in rows.tolist()], self._eos(), self.config.pad_response)

    def step(self) -> StepReport:
        """One batch of this process; the optimizer steps now (alone) or once the peers' samples reach the
        collaboration's target (the ``epoch`` then advances)."""
        started = time.perf_counter()
        self.optimizer.zero_grad()
        epoch = self.state.epoch
        loss = sft_loss(self.backbone, self.adapter, self.next_batch(), self.generator)
        loss.backward()
        if self.config.max_grad_norm:  # a rare huge gradient (a loss spike) moves the adapter no further than usual
            torch.nn.utils.clip_grad_norm_(list(self.adapter.parameters()), self.config.max_grad_norm)
        set_lr(self.optimizer, self.config.lr_at(epoch))
        self.optimizer.step()
        seconds = time.perf_counter() - started
        self.state.step += 1
        self.state.epoch = self.optimizer.local_epoch if self.collaborative else self.state.step
        if self.collaborative and not self._joined:
            wait_for_peers(self.optimizer, self.config.collaboration)
            self._joined = True
        peers = peers_in_run(self.optimizer) if self.collaborative else 1
        self.state.losses.append(loss.item())
        self.state.epochs.append(epoch)
        self.state.peers.append(peers)
        self.state.wall_s += seconds
        return StepReport(self.state.step, self.state.losses[-1], seconds, self.state.epoch, peers)

    def run(self, progress: bool = True) -> list[StepReport]:
        """Train up to ``config.steps`` optimizer steps (from wherever the run stands), saving every
        ``save_every`` and at the end; in a collaboration, the progress tracker idles until the next run."""
        self._idle.close()
        reports = []
        bar = tqdm(total=self.config.steps, initial=self.state.epoch, desc="finetune", unit="step",
                   disable=not progress)
        with bar:
            while self.state.epoch < self.config.steps:
                saved_at = self.state.epoch // self.config.save_every
                report = self.step()
                reports.append(report)
                bar.update(min(report.epoch, self.config.steps) - bar.n)
                postfix = dict(loss=f"{report.loss:.4f}", avg=f"{self.smoothed_loss():.4f}")
                bar.set_postfix(postfix if not self.collaborative else dict(postfix, peers=report.peers))
                if self.state.epoch // self.config.save_every > saved_at:
                    self.save()
        self.save()
        (self.output / "losses.json").write_text(json.dumps(self.state.losses))
        history = [dict(epoch=e, loss=loss, peers=p) for e, loss, p in
                   zip(self.state.epochs, self.state.losses, self.state.peers)]
        (self.output / "history.json").write_text(json.dumps(history))
        if self.collaborative:
            self._idle.enter_context(idle(self.optimizer))
        return reports
