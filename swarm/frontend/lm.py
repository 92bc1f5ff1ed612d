"""The user-facing generation API shared by the local model and the distributed client.

Subclasses only say how to obtain a :class:`~swarm.diffusion.Denoiser` for one generation; tokenising,
argument checking, the sampler, streaming, progress and the result object live here once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import secrets
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, Sequence

import torch
from tqdm.auto import tqdm

from swarm.adapters.adapter import AdapterError, PromptAdapter, base_of, check_fits
from swarm.adapters.block import BlockAdapter
from swarm.diffusion.auto_experts import AUTO_RULES, auto_experts, expert_weights
from swarm.diffusion.composition import Composition
from swarm.diffusion.config import GenerationConfig, GenerationLimits, settings_of
from swarm.diffusion.experts import ExpertSource
from swarm.diffusion.pipeline import DenoiserCalls, Forward
from swarm.diffusion.sampler import DiffusionSampler, Halted, WindowStats
from swarm.frontend.request import GenerationRequest
from swarm.frontend.scale import ScalePlan, plan_scale
from swarm.models.config import ModelConfig
from swarm.models.invariance import DeviceInvariance
from swarm.models.modules import HeadLoRA
from swarm.models.tokenizer import MASK_PLACEHOLDER, Tokenizer
from swarm.utils.text import listed

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_LENGTH: int = GenerationConfig.block_length  # the declared default (a dataclass keeps it on the class)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids, cut before the first EOS
    prompt_ids: list[int]
    sequence: torch.Tensor  # the final state: prompt, generated ids, EOS padding or leftover masks
    finish_reason: str  # "eos" or "length"
    steps: int
    denoiser_calls: int  # sequential round trips to the denoiser
    states_evaluated: int
    windows: list[WindowStats]
    elapsed_s: float
    telemetry: list[dict] = field(default_factory=list)  # per accepted step, with experts or correctors
    info: dict[str, Any] = field(default_factory=dict)  # route, experts, warnings and other run details


@dataclass
class StreamChunk:
    """The state after one step; the last chunk has ``done`` set and carries the result."""

    step: int
    block: int
    text: str  # generated text so far, masks shown as "_"
    masked_left: int
    done: bool = False
    result: Optional[GenerationResult] = None
    telemetry: dict = field(default_factory=dict)
    # What a page needs to draw the canvas (docs/WEB.md), per generated position and as the step happens:
    tokens: list[Optional[str]] = field(default_factory=list)  # each position's text, None while masked
    unmasked: list[int] = field(default_factory=list)  # positions this step filled (0: the first generated one)
    route: list[str] = field(default_factory=list)  # the hops the request is routed through (empty in one process)
    failovers: list[dict] = field(default_factory=list)  # this request's failovers so far


def files_stamp(name_or_path: str) -> Optional[tuple[tuple[str, int, int], ...]]:
    """(name, modification time, size) of each file of a directory; None for anything else (a published name)."""
    directory = Path(name_or_path)
    if not directory.is_dir():
        return None
    stats = ((f.name, f.stat()) for f in directory.iterdir() if f.is_file())
    return tuple(sorted((name, stat.st_mtime_ns, stat.st_size) for name, stat in stats))


@dataclass(frozen=True)
class CheckedRequest:
    """One request's settings after every bound was checked (:meth:`BaseDiffusionLM.check_request`)."""

    generation: GenerationConfig
    plan: ScalePlan
    options: GenerationRequest  # its experts possibly filled in by the scale
    expert_count: int  # experts computing alongside the backbone (for the memory bound)


RANDOM_SEEDS = 2**31  # a seed drawn for a request that gave none is below this: short enough to type again

# Synonyms taken as the setting they name: Hugging Face's max_new_tokens is gen_length (the command line's
# --max-new-tokens too, declared beside --gen-length).
SYNONYMS = {"max_new_tokens": "gen_length"}
# Other libraries' names refused with a hint rather than taken silently (OpenAI's max_tokens belongs to the HTTP API).
OTHER_NAMES = {"max_tokens": "gen_length", "num_steps": "steps"}


def take_synonyms(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with each synonym (:data:`SYNONYMS`) replaced by the setting it names; a ValueError when both
    are given and disagree."""
    taken = dict(settings)
    for synonym, name in SYNONYMS.items():
        if synonym not in taken:
            continue
        value = taken.pop(synonym)
        if name in taken and taken[name] != value:
            raise ValueError(f"{synonym}={value!r} and {name}={taken[name]!r} disagree: {synonym} is {name}; "
                             "give one of them")
        taken[name] = value
    return taken


def make_generation_config(
    gen_length: int = GenerationConfig.gen_length,
    steps: Optional[int] = None,
    block_length: Optional[int] = None,
    **settings: Any,
) -> GenerationConfig:
    """Fill the length-dependent defaults: one token per step, blocks of 32 where they divide.

    Any other keyword must be a field of :class:`GenerationConfig` (else a TypeError names it; synonyms such as
    ``max_new_tokens`` are taken before, by :func:`take_synonyms`).
    """
    unknown = sorted(set(settings) - {declared.name for declared in settings_of(GenerationConfig)})
    if unknown:
        hints = [f"use {OTHER_NAMES[name]}={settings[name]!r} instead of {name}" for name in unknown
                 if name in OTHER_NAMES]
        documented = "see generate_stream's documentation"
        advice = f"{'; '.join(hints)} ({documented})" if hints else documented
        raise TypeError(f"unknown {listed('generation argument', unknown)}: {advice}")
    if block_length is None:
        divides = isinstance(gen_length, int) and gen_length % DEFAULT_BLOCK_LENGTH == 0
        block_length = DEFAULT_BLOCK_LENGTH if divides else gen_length
    if steps is None:
        steps = gen_length
    return GenerationConfig(gen_length=gen_length, steps=steps, block_length=block_length, **settings)


def check_request(limits: GenerationLimits, sampling_defaults: Mapping[str, Any], remote: bool,
                  prompt_ids: Optional[Sequence[int]], options: GenerationRequest,
                  settings: dict[str, Any],
                  invariance: Optional[Callable[[], DeviceInvariance]] = None) -> CheckedRequest:
    """Check one request against its bounds and a model's ``limits`` (:meth:`BaseDiffusionLM.check_request`); also
    usable before the model is loaded or a swarm joined (``python -m swarm.generate`` checks its flags so)."""
    expert_count = options.check()
    settings = take_synonyms(settings)
    plan = plan_scale(options.scale, settings, remote=remote, experts=options.experts,
                      correctors=options.corrector_steps, invariance=invariance)
    if plan.experts is not None:
        options = dataclasses.replace(options, experts=plan.experts)
    if options.experts == "auto":
        expert_count = len(AUTO_RULES)  # at most every rule matches
    chosen = {k: v for k, v in sampling_defaults.items() if k not in plan.settings} | settings
    generation = make_generation_config(**chosen, **plan.settings)
    if "seed" not in chosen and generation.temperature > 0:  # sampling: a new text each time unless a seed is given
        generation = generation.replace(seed=secrets.randbelow(RANDOM_SEEDS))
    prompt_length = None if prompt_ids is None else len(prompt_ids)
    if "parallel_window" in plan.filled:  # the scale's choice, not the caller's: fit it to the budget
        room = limits.window_room(generation, prompt_length or 1, expert_count)
        generation = generation.replace(parallel_window=min(generation.parallel_window, room))
    if "draft_steps" in plan.filled:  # likewise: a call verifies draft_steps + 1 states
        room = limits.window_room(generation, prompt_length or 1, expert_count)
        generation = generation.replace(draft_steps=min(generation.draft_steps, room - 1))
    limits.check(generation, prompt_length, expert_count)
    return CheckedRequest(generation, plan, options, expert_count)


class Backbone(Protocol):
    """The frozen model as three differentiable pieces, what training an adapter needs (:mod:`swarm.finetune.trainer`):
    the embedding (no gradient needed), the blocks (a function of the hidden states and of a per-block adapter's
    weights) and the head (with an adapter's head correction). Only the adapter's tensors take gradients."""

    config: ModelConfig
    through_swarm: bool  # the blocks are computed by servers (recorded with a trained adapter)

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def blocks(self, hidden: torch.Tensor, adapter: Optional[BlockAdapter] = None) -> torch.Tensor: ...

    def head(self, hidden: torch.Tensor, lora: Optional[HeadLoRA] = None) -> torch.Tensor: ...


class BaseDiffusionLM(ABC):
    """``generate`` / ``generate_stream`` over whatever computes the logits."""

    config: ModelConfig
    tokenizer: Tokenizer
    remote = False  # True when every denoiser call is a round trip through the network
    _limits: Optional[GenerationLimits] = None
    _sampling_defaults: Mapping[str, Any] = MappingProxyType({})

    @property
    def sampling_defaults(self) -> Mapping[str, Any]:
        """The model's own defaults for some sampler settings (``generation.json``); the caller's settings win."""
        return self._sampling_defaults

    @sampling_defaults.setter
    def sampling_defaults(self, defaults: Mapping[str, Any]) -> None:
        GenerationConfig(**defaults)  # refuses out-of-range values, naming them, as for any request
        self._sampling_defaults = MappingProxyType(dict(defaults))

    @property
    def limits(self) -> GenerationLimits:
        """Bounds of one request from this model and this machine; assign to change the memory budget."""
        if self._limits is None:
            self._limits = GenerationLimits.for_model(self.config)
        return self._limits

    @limits.setter
    def limits(self, limits: GenerationLimits) -> None:
        self._limits = limits

    @abstractmethod
    def denoising_session(self, generation: GenerationConfig,
                          adapter: Optional[PromptAdapter] = None) -> contextlib.AbstractContextManager[Forward]:
        """The model's pass for one generation (remote sessions are opened and closed around it).

        It honours cache directives (:mod:`swarm.diffusion.pipeline`); the sampler's denoiser is built on it.
        With an ``adapter`` its prompt vectors go before the embedded sequence and its rows are sliced off
        before the head.
        """

    @abstractmethod
    def backbone(self) -> Backbone:
        """This model as differentiable pieces for training an adapter (its weights frozen by this call)."""

    def load_adapter(self, name_or_path: Optional[str]) -> Optional[PromptAdapter]:
        """The adapter a request names (a directory; subclasses may also find published names), checked against
        this model; loaded once per name, and again when a directory's files changed (a run that goes on training
        into it). :class:`AdapterError` (a ValueError) says what is wrong."""
        if name_or_path is None:
            return None
        if not isinstance(name_or_path, str) or not 0 < len(name_or_path) <= 4096:
            raise AdapterError(f"adapter must be a directory or a published name, got {name_or_path!r}")
        cache = self.__dict__.setdefault("_adapters", {})
        stamp = files_stamp(name_or_path)
        if name_or_path not in cache or cache[name_or_path][0] != stamp:
            cache[name_or_path] = (stamp, self.find_adapter(name_or_path, base_of(self.config, self.tokenizer)))
        return cache[name_or_path][1]

    def request_adapter(self, options: GenerationRequest, prompt_ids: Sequence[int], gen_length: int
                        ) -> tuple[Optional[PromptAdapter], Optional[str]]:
        """The adapter of a request and its name: the one it names, or with ``experts="auto"`` and none named, the one
        :meth:`auto_adapter` finds for the prompt's domains (best effort: one that cannot be used is skipped with a
        warning, as ``"auto"`` skips experts that are missing)."""
        if options.adapter is not None or options.experts != "auto":
            adapter = self.load_adapter(options.adapter)
            if adapter is not None:
                check_fits(adapter, len(prompt_ids) + gen_length, self.config.max_position_embeddings)
            return adapter, options.adapter
        name = self.auto_adapter(list(auto_experts(self.tokenizer.decode(list(prompt_ids)))))
        if name is None:
            return None, None
        try:
            adapter = self.load_adapter(name)
            check_fits(adapter, len(prompt_ids) + gen_length, self.config.max_position_embeddings)
        except AdapterError as error:
            logger.warning("experts='auto': not using adapter %s: %s", name, error)
            return None, None
        return adapter, name

    def auto_adapter(self, domains: Sequence[str]) -> Optional[str]:
        """An adapter for ``experts="auto"`` in the prompt's ``domains`` (:func:`auto_experts`' names), or None.
        Locally none; the swarm client picks the best audited one (``DistributedDiffusionLM.auto_adapter``)."""
        return None

    def forget_adapter(self, name_or_path: str) -> None:
        """Drop the adapter loaded for ``name_or_path``: the next request loads it again (a published name may hold
        other content by now)."""
        self.__dict__.get("_adapters", {}).pop(name_or_path, None)

    def find_adapter(self, name_or_path: str, base: dict[str, Any]) -> PromptAdapter:
        """An adapter directory (the swarm client also resolves published names)."""
        return PromptAdapter.load(name_or_path, base)

    def denoiser_workers(self, generation: GenerationConfig) -> int:
        """Threads for denoiser calls in flight: none locally (calls run at once, in order)."""
        return 0

    def begin_request(self, prompt: str | Sequence[int], prompt_ids: Sequence[int], tier: Optional[str],
                      plan: ScalePlan) -> dict[str, Any]:
        """Per-request policy before any compute (the swarm client classifies the safety tier here).

        Returns details added to the result's ``info``. (The tier was checked with the request's options.)
        """
        return {}

    def finish_request(self, result: "GenerationResult") -> None:
        """Called with every result (the swarm client writes its audit record here)."""

    def run_info(self) -> dict[str, Any]:
        """Details added to each result (the distributed client reports its route)."""
        return {}

    def open_experts(self, names: Sequence[str], required: bool) -> tuple[dict[str, ExpertSource], list[str]]:
        """Sources for the named experts and warnings about skipped ones.

        Subclasses load them (local) or find their servers (swarm). A missing or incompatible expert raises
        (``ExpertNotFoundError``, ``IncompatibleExpertError``) when ``required``; otherwise
        (``experts="auto"``) it is skipped with a warning.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot compose experts")

    def composition(
        self, generation: GenerationConfig, prompt_ids: Sequence[int], experts: Any, tau: float, corrector_steps: int,
        top_k: int = 0,
    ) -> Optional[Composition]:
        """Experts and correctors of one request, or None when it asks for neither (the plain sampler)."""
        if experts is None and not corrector_steps:
            return None
        weights, auto = expert_weights(experts, self.tokenizer.decode(list(prompt_ids)))
        sources, warnings = self.open_experts(list(weights), required=not auto) if weights else ({}, [])
        weights = {name: weight for name, weight in weights.items() if name in sources}
        return Composition(sources, weights, generation, self.config.mask_token_id, tau=tau,
                           corrector_steps=corrector_steps, warnings=warnings, auto=auto, top_k=top_k)

    def check_request(self, prompt_ids: Optional[Sequence[int]] = None, **kwargs: Any) -> CheckedRequest:
        """Check every argument of a request (``generate``'s keywords) against its bound before any compute;
        ValueError says which.

        Both front ends go through here (from :meth:`generate_stream`), and the HTTP API calls it before a
        request waits for the model (``prompt_ids`` None: the prompt counts as one token until it is known).
        """
        return self._check(prompt_ids, *GenerationRequest.split(kwargs))

    def _check(self, prompt_ids: Optional[Sequence[int]], options: GenerationRequest,
               settings: dict[str, Any]) -> CheckedRequest:
        return check_request(self.limits, self.sampling_defaults, self.remote, prompt_ids, options, settings,
                             self.batch_invariance)

    @abstractmethod
    def batch_invariance(self) -> DeviceInvariance:
        """Whether this model's passes are batch-invariant (batched states give the sequential run's tokens), and
        why: the scale batches states only where they are (``info["settings"]["batching"]``)."""

    # ----- prompts ----------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Text gets BOS and its ids; ``chat`` wraps text in the tokenizer's chat template instead."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give some text")
            if chat:
                return self.tokenizer.encode_chat(prompt)  # the template writes its own BOS
            ids = self.tokenizer.encode(prompt)
            bos = self.tokenizer.bos_token_id
            return ([bos] if bos is not None else []) + ids
        if chat:
            raise ValueError("chat=True needs the prompt as text, not token ids")
        if len(prompt) >= self.config.max_position_embeddings:  # before looking at each id
            raise ValueError(f"the prompt has {len(prompt)} tokens: the model's context is "
                             f"{self.config.max_position_embeddings} positions, including the generated ones")
        ids = [int(i) for i in prompt]
        if not ids:
            raise ValueError("the prompt is empty: give at least one token id")
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {self.config.vocab_size})")
        return ids

    def eos_token_ids(self) -> tuple[int, ...]:
        ids = {self.config.eos_token_id, self.config.eot_token_id, self.tokenizer.eos_token_id}
        return tuple(sorted(i for i in ids if i is not None))

    # ----- generation -------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult:
        """Generate text; see :meth:`generate_stream` for the arguments."""
        result = None
        for chunk in self.generate_stream(prompt, **kwargs):
            result = chunk.result
        if result is None:
            raise RuntimeError("generation ended without a result")
        return result

    def generate_stream(self, prompt: str | Sequence[int], **kwargs: Any) -> Iterator[StreamChunk]:
        """Yield the partially unmasked text after every step; the last chunk carries the result.

        Keyword arguments, the sampler's settings (:class:`GenerationConfig`): ``gen_length``, ``steps``,
        ``block_length``, ``temperature``, ``remasking`` (low_confidence, random, margin, entropy), ``threshold``,
        ``cfg_scale``, ``seed``, ``stop_at_eos``, ``parallel_window``, ``draft_steps``, and the latency-hiding settings
        ``staleness`` (0..8), ``stale_check`` (``token``, ``exact``, ``none``), ``cache`` (``none``, ``prefix``,
        ``dual``), ``cache_refresh`` and ``cache_refresh_drift`` (approximate except at their defaults, which are exact;
        ``stale_check="exact"`` keeps the tokens of the run without staleness).

        Unset ``temperature``, ``remasking``, ``threshold`` and ``cfg_scale`` take the model's defaults (its
        ``generation.json``), else the declared ones. Without a ``seed`` a sampling run (temperature above 0) draws a
        random one, so each call gives new text; a given seed gives the same tokens every time. The values used are
        in the result's ``info["settings"]``. (``max_new_tokens`` is taken as ``gen_length``.)

        The request's other options (:class:`GenerationRequest`): ``experts`` composes expert models with the
        backbone at every step: ``{"code": 0.5}`` (weights >= 0) or ``"auto"`` (chosen from the prompt);
        ``expert_tau`` bounds each expert's per-token shift; ``expert_top_k`` is how many tokens per position each
        expert answers (0: the whole vocabulary); ``corrector_steps`` re-predicts the least confident
        decided tokens after each step. Per-step telemetry is in ``StreamChunk.telemetry`` and
        ``GenerationResult.telemetry`` (docs/EXPERTS.md). ``tier`` asks for a stricter safety tier than the
        prompt's own (docs/GOVERNANCE.md); a governance halt ends the stream with ``finish_reason == "halted"``
        and ``info["halt"]``. ``scale`` (``local``, ``auto``, ``max``) sizes how much of the swarm the request
        uses (:mod:`swarm.frontend.scale`). ``chat`` wraps the text prompt in the tokenizer's chat template (instruct
        checkpoints); ``progress`` shows a progress bar. ``adapter`` applies a fine-tuned adapter (a
        directory written by ``python -m swarm.finetune``, or a published name; docs/TRAINING.md).

        Every setting is bounded (:meth:`check_request`, :mod:`swarm.diffusion.config`): out-of-range,
        infinite or NaN values and requests too large for the model's context or the memory budget
        (:attr:`limits`) raise ValueError before any compute; an unknown keyword raises TypeError.
        """
        options, settings = GenerationRequest.split(kwargs)
        prompt_ids = self.encode_prompt(prompt, chat=options.chat)
        request = self._check(prompt_ids, options, settings)
        generation, plan, options = request.generation, request.plan, request.options
        started = time.perf_counter()
        request_info = {**self.begin_request(prompt, prompt_ids, options.tier, plan), **plan.info()}
        composition = self.composition(generation, prompt_ids, options.experts, options.expert_tau,
                                       options.corrector_steps, options.expert_top_k)
        adapter, adapter_name = self.request_adapter(options, prompt_ids, generation.gen_length)
        if adapter is not None:
            request_info["adapter"] = {"name": adapter_name, "prompt_length": adapter.length,
                                       "auto": options.adapter is None}
        telemetry: list[dict] = []
        pieces = self._token_pieces()
        bar = tqdm(total=generation.gen_length, desc="denoising", unit="tok", disable=not options.progress,
                   leave=False)
        with self.denoising_session(generation, adapter) as forward, bar:
            denoiser = DenoiserCalls(forward, generation, self.config.logits_shift, self.denoiser_workers(generation))
            if composition is None:
                sampler = DiffusionSampler(denoiser, generation, self.config.mask_token_id, self.eos_token_ids())
            else:
                sampler = composition.sampler(denoiser, self.eos_token_ids())
            state = sampler.initial_state(prompt_ids)
            halt: Optional[Halted] = None
            try:
                for event in sampler.iterate(prompt_ids):
                    state = event.tokens
                    bar.update(len(event.unmasked))
                    step_telemetry = composition.telemetry(event.step) if composition else event.telemetry
                    if composition:
                        telemetry.append(step_telemetry)
                    generated = state[len(prompt_ids):].tolist()
                    yield StreamChunk(
                        step=event.step, block=event.block, masked_left=event.masked_left,
                        text=self.tokenizer.decode(generated, mask_placeholder=MASK_PLACEHOLDER),
                        telemetry=step_telemetry, tokens=pieces(generated),
                        unmasked=[position - len(prompt_ids) for position in event.unmasked], **self._progress(),
                    )
            except Halted as stop:  # e.g. a governance halt: stop cleanly, say why and where
                halt = stop
            finally:
                denoiser.close()
            result = self._result(prompt_ids, state, sampler, time.perf_counter() - started, composition, telemetry)
            result.info["settings"] = dataclasses.asdict(generation)  # the values used: model defaults, drawn seed
            result.info["settings"]["batching"] = plan.batching_info(generation.states_per_call)
            result.info["staleness"] = {"steps": generation.staleness, "check": generation.stale_check,
                                        "guessed": sampler.stats.guessed, "overturned": sampler.stats.overturned}
            result.info["cache"] = {"mode": generation.cache, "fills": denoiser.policy.fills,
                                    "reuses": denoiser.policy.reuses, "misses": denoiser.misses,
                                    "rebuilds": denoiser.rebuilds, "drift_fills": denoiser.policy.drift_fills}
            if halt is not None:
                result.finish_reason = "halted"
                result.info["halt"] = {"reason": halt.reason, "step": halt.step, **halt.details}
            result.info.update(request_info)
            self.finish_request(result)
        yield StreamChunk(step=result.steps - 1, block=-1, text=result.text, masked_left=0, done=True, result=result)

    def _token_pieces(self) -> Callable[[list[int]], list[Optional[str]]]:
        """Each generated position's own text (None while masked), decoding each distinct id once per request."""
        mask = self.config.mask_token_id
        piece = functools.lru_cache(maxsize=4096)(lambda token: self.tokenizer.decode([token]))
        return lambda ids: [None if token == mask else piece(token) for token in ids]

    def _progress(self) -> dict[str, Any]:
        """The route and failovers so far, for each streamed step (the result has them all at the end)."""
        info = self.run_info()
        return {"route": list(info.get("route", [])), "failovers": list(info.get("failovers", []))}

    def _result(self, prompt_ids: list[int], state: torch.Tensor, sampler: DiffusionSampler, elapsed: float,
                composition: Optional[Composition] = None, telemetry: Optional[list[dict]] = None) -> GenerationResult:
        generated = state[len(prompt_ids):].tolist()
        eos = set(self.eos_token_ids())
        cut = next((i for i, t in enumerate(generated) if t in eos), None)
        token_ids = generated if cut is None else generated[:cut]
        token_ids = [t for t in token_ids if t != self.config.mask_token_id]
        stats = sampler.stats
        info = self.run_info()
        info["warnings"] = list(info.get("warnings", []))
        if composition is not None:
            info["experts"] = composition.info()
            info["warnings"] += composition.warnings
        return GenerationResult(
            text=self.tokenizer.decode(token_ids), token_ids=token_ids, prompt_ids=prompt_ids, sequence=state,
            finish_reason="eos" if cut is not None else "length",
            steps=sum(w.accepted for w in stats.windows), denoiser_calls=stats.denoiser_calls,
            states_evaluated=stats.states_evaluated, windows=list(stats.windows), elapsed_s=elapsed,
            telemetry=list(telemetry or []), info=info,
        )
