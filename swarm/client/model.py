"""``DistributedDiffusionLM``: the client holds embeddings and head, the swarm holds the blocks."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from hivemind.dht import DHT

from swarm.adapters.adapter import AdapterError, PromptAdapter
from swarm.adapters.sharing import MAX_CATALOG_NAMES, default_cache_dir
from swarm.adapters.versions import fetch_reference, published_versions, reference_of
from swarm.client.backbone import SwarmBackbone
from swarm.client.check_memory import CheckMemory
from swarm.client.config import ClientConfig, client_network
from swarm.client.experts import RemoteExpert, open_remote_experts
from swarm.client.head_use import HeadUse
from swarm.client.planner import RoutePlanner
from swarm.client.proofs import Finding, Verdict, verify_evidence
from swarm.client.push import PushReceiver
from swarm.client.receipts import ReceiptBook, save_sample
from swarm.client.reference import LocalReference
from swarm.client.routing import RouteHop, compress_ranges
from swarm.client.sequence import RemoteSequence
from swarm.dht.compatibility import CompatibilityTag
from swarm.dht.node import start_dht, stop_dht
from swarm.dht.peers import require_initial_peers
from swarm.dht.schema import ServerState, default_prefix, protected_keys
from swarm.diffusion.config import GenerationConfig
from swarm.diffusion.pipeline import CacheDirective, Forward, check_head_rows, rows_to_score
from swarm.diffusion.prediction import HeadQuery, Predictions
from swarm.diffusion.sampler import DenoiseContext
from swarm.frontend.lm import BaseDiffusionLM, StreamChunk
from swarm.frontend.local import DiffusionLM
from swarm.frontend.scale import ScalePlan, check_scale
from swarm.governance.audit import AuditLog
from swarm.governance.guard import GovernanceGuard
from swarm.governance.keys import trusted_signers
from swarm.governance.tiers import TierRules
from swarm.models.invariance import DeviceInvariance, check_module
from swarm.models.loading import DEFAULT_MODEL, ModelFiles
from swarm.models.modules import OutputHead
from swarm.reports.adoption import choose
from swarm.reports.records import BEST, AuditBook, trusted_auditors
from swarm.utils.event_loop import BackgroundLoop
from swarm.utils.settings import replaced
from swarm.utils.text import listed, plural
from swarm.utils.threads import use_threads
from swarm.weights.source import SwarmWeights
from swarm.weights.trust import PublisherTrust
from swarm.wire.evidence import CallEvidence
from swarm.wire.handoff import MAX_PER_HANDOFF, hand_evidence
from swarm.wire.messages import ErrorCode, RemoteError
from swarm.wire.remote import RemoteCaller
from swarm.wire.work import stamper_for

logger = logging.getLogger(__name__)

HANDOFF_GRACE_S = 10.0  # how long shutdown waits for the sample's hand-off to auditors in flight


class StepTimings:
    """Seconds the client spent per phase of its denoiser calls (embedding, swarm, head), summed since the last
    :meth:`reset`: what ``python -m swarm.benchmark realscale`` reports per step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls = 0

    @contextlib.contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started
            self.calls += phase == "embedding"

    def reset(self) -> None:
        self.seconds, self.calls = {}, 0


class DistributedDiffusionLM(BaseDiffusionLM):
    """Same ``generate`` / ``generate_stream`` as :class:`swarm.DiffusionLM`, with the blocks on remote servers.

    ``DistributedDiffusionLM.from_pretrained("default", initial_peers=[...])`` reads only the tokenizer,
    embeddings, final norm and head; each denoising step goes through a route of servers covering every block.
    """

    remote = True

    def __init__(self, files: ModelFiles, config: ClientConfig, dht: Optional[DHT] = None):
        config.validate()
        if dht is None:  # before loading anything: no peers at all is one line, not a wait for absent servers
            require_initial_peers(config.network.initial_peers, config.network.use_default_peers)
        self.files = files
        self.config = files.config
        self.client_config = config
        self.tokenizer = files.tokenizer()
        self.sampling_defaults = files.sampling_defaults()
        check_head_rows(config.head_rows)
        # The checkpoint's dtype, as servers default to: bfloat16 halves the client's memory and the wire's bytes
        self.embedding = files.embedding(config.dtype)
        self._head: Optional[OutputHead] = None  # loaded on first use: not at all while head servers answer
        self.compute_dtype = next(self.embedding.parameters()).dtype
        self.timings = StepTimings()
        self.head_use = HeadUse()
        self.prefix = config.dht_prefix or default_prefix(files.path)
        self._own_dht = dht is None
        auditors = trusted_auditors(config.trusted_auditors, config.governance_keys)
        self.dht = dht if dht is not None else start_dht(config.network, protect=protected_keys(
            self.prefix, self.config.num_layers, trusted_signers(config.governance_keys), auditors=auditors))
        self.loop = BackgroundLoop.shared()
        self.p2p = self.loop.run(self.dht.replicate_p2p())
        self.caller = RemoteCaller(self.p2p, config.wire_dtype, config.inject_latency, config.inject_jitter,
                                   adapter_by_digest=config.adapter_by_digest,
                                   stamper=stamper_for(str(self.p2p.peer_id), self.config, config.work_price))
        self.planner = RoutePlanner(self.dht, self.caller, self.loop, self.prefix, self.config.num_layers,
                                    self.config.hidden_size, config, self.config.vocab_size,
                                    self.config.mask_token_id)
        self.planner.audits = AuditBook(self.prefix, frozenset(auditors))
        self.sequence = RemoteSequence(self.planner)
        self.receipts = ReceiptBook(config.audit_share)  # every answer's receipt, and a sample for auditors
        self.caller.on_receipt = self.receipts.record
        self.sequence.spot_checker.receipts = self.receipts
        # Challenges embed random tokens; spot checks of a head server score a replica's hidden states with this
        # client's head, only when they arrive unrounded and the head computes in the servers' dtype (otherwise its
        # numbers would differ from an honest head server's)
        exact = self.compute_dtype == files.default_dtype and config.wire_dtype == "auto"
        self.sequence.use_client_parts(self.embedding, (lambda: self.head) if exact else None,
                                       self.config.max_position_embeddings)
        if exact and config.spot_check_local and not self.missing_blocks():  # a hop nobody else holds: recompute it
            self.sequence.spot_checker.reference = LocalReference(
                lambda start, end: files.span(start, end, config.dtype), lambda: self.head, self.config.num_layers)
        self.sequence.spot_checker.memory = CheckMemory(
            config.spot_check_memory_mb, lambda start, end: files.span_bytes(start, end, config.dtype),
            lambda: files.head_bytes(config.dtype), lambda: self._head is not None)
        self._only_peers: Optional[frozenset[str]] = None
        self.guard = GovernanceGuard(self.dht, self.prefix, config.governance_keys, ttl=config.governance_ttl,
                                     stale_after=config.governance_stale_after)
        self.tier_rules = TierRules.from_file(config.tier_rules_path) if config.tier_rules_path else TierRules()
        self.audit = AuditLog(config.audit_log)
        self._handing: Optional[Future] = None  # the sample's hand-off to evidence_auditors, while in flight
        self._spot_checks_seen = self._failovers_seen = 0
        self._local: Optional[DiffusionLM] = None
        self._receiver: Optional[PushReceiver] = None
        # task -> (when chosen, name@AUTHOR@VERSION, its sha256) for adapter="best:" (swarm.reports.adoption)
        self.best_adapters: dict[str, tuple[float, str, str]] = {}

    @classmethod
    def from_pretrained(
        cls, name_or_path: str | Path = DEFAULT_MODEL, *, initial_peers: Sequence[str] | str = (),
        config: Optional[ClientConfig] = None, dht: Optional[DHT] = None, threads: Optional[int] = None,
        **overrides: Any,
    ) -> "DistributedDiffusionLM":
        """``initial_peers``: multiaddrs, as a list or one string. ``overrides`` set :class:`ClientConfig` fields
        (``request_timeout=…``, ``dht_prefix=…``) on a copy: a ``config`` passed in is never changed. ``threads``:
        torch's CPU threads, set for the process as the commands set them
        (:func:`~swarm.utils.threads.use_threads`)."""
        config = replaced(config or ClientConfig(network=client_network(initial_peers)), "client option", **overrides)
        use_threads(threads)
        # names by them; a model id or name resolved through ``dht`` when one is given (no peer of its own)
        weights = SwarmWeights(config.network, trust=PublisherTrust.of((), config.governance_keys), dht=dht)
        return cls(ModelFiles(name_or_path, resolvers=[weights.resolve]), config, dht)

    @property
    def only_peers(self) -> Optional[frozenset[str]]:
        """The peers every request may route through (None: any)."""
        return self._only_peers

    @only_peers.setter
    def only_peers(self, peers: Optional[frozenset[str]]) -> None:
        """Restrict the route at once, not only from the next request: :meth:`show_route` and the route's refresh
        then challenge and plan over these peers alone (each request applies its tier's policy again)."""
        self._only_peers = peers
        self.sequence.allow_only(peers)

    @property
    def head(self) -> OutputHead:
        """The final norm and output head, read from the checkpoint the first time this client computes it."""
        if self._head is None:
            logger.info("loading the output head into the client")
            with torch.inference_mode(False):  # first needed inside a denoiser call: fine-tuning needs normal tensors
                self._head = self.files.head(self.client_config.dtype)
        return self._head

    def batch_invariance(self) -> DeviceInvariance:
        """Batch-invariant only if every server a route may use says its passes are, and this client's own head
        (when no usable server holds one) is too: a state's numbers then do not depend on what shares its call."""
        if not self.planner.servers:
            self.planner.refresh()
        excluded = self.planner.excluded()
        usable = {peer: record for peer, record in self.planner.servers.items()
                  if record.state == ServerState.ONLINE and peer not in excluded}
        if not usable:
            return DeviceInvariance(False, "no usable server is known yet")
        varying = sorted(peer for peer, record in usable.items() if not record.batch_invariant)
        if varying:
            return DeviceInvariance(False, "passes that are not batch-invariant, as announced by "
                                           f"{listed('server', [peer[-8:] for peer in varying])}")
        if not any(record.head for record in usable.values()):
            own = check_module(self.head)
            if not own.exact:
                return DeviceInvariance(False, f"this client's head: {own.why}")
        return DeviceInvariance(True, f"every usable server ({len(usable)}) announces batch-invariant passes")

    def backbone(self) -> SwarmBackbone:
        return SwarmBackbone(self.config, self.sequence, self.embedding, self.head, self.compute_dtype)

    # ----- the denoiser ---------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor, session_id: Optional[str] = None, step: int = -1,
               directive: Optional[CacheDirective] = None, scored: Optional[tuple[int, int]] = None,
               head: Optional[HeadQuery] = None, adapter: Optional[PromptAdapter] = None) -> torch.Tensor | Predictions:
        """Per-position logits computed through the swarm (same contract as ``DiffusionLM.logits``).

        With a reuse ``directive`` only its rows are embedded, sent and scored (the servers hold the rest); with
        ``scored`` the head computes only those absolute positions (the other rows are NaN). With a ``head``
        query a head server at the route's end may answer the sampler's predictions instead (returned as is).
        An ``adapter``'s prompt positions go before the embedded rows (the servers see them as more positions; a
        per-block adapter's tensor travels with each hop) and are sliced off before the head.
        """
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        cache, offset, reuse = None, 0, directive is not None and not directive.fill
        if directive is not None:
            rows = adapter.shift(directive.rows) if adapter is not None else directive.rows
            cache = dataclasses.replace(directive, rows=rows)
            if reuse:
                offset = directive.rows[0]
                input_ids = input_ids[:, directive.rows[0]:directive.rows[1]]
        with self.timings.measure("embedding"):
            hidden = self.embedding(input_ids)  # in the compute dtype: the wire carries it as is by default
            if adapter is not None and not reuse:
                hidden = adapter.extend(hidden)
        with self.timings.measure("swarm"):
            per_block = adapter.block_adapter if adapter is not None else None
            hidden = self.sequence.forward(hidden, session_id, step, cache, head, adapter=per_block)
        if isinstance(hidden, Predictions):  # asked of the extended rows: named by the sequence's own again
            return hidden if adapter is None else Predictions(hidden.rows, head.shifted(-adapter.length),
                                                              hidden.vocab_size)
        if adapter is not None and not reuse:
            hidden = adapter.strip(hidden)
        with self.timings.measure("head"):
            hidden = hidden.to(self.compute_dtype)
            lora = adapter.head_lora if adapter is not None else None  # an adapter's head correction, held here
            if scored is None:
                return self.head(hidden, lora).float()
            return self.head.score_rows(hidden, offset, scored, lora)

    @contextlib.contextmanager
    def denoising_session(self, generation: GenerationConfig,
                          adapter: Optional[PromptAdapter] = None) -> Iterator[Forward]:
        session_id = uuid.uuid4().hex
        self._use_push(self.client_config.push)
        self.planner.refresh_if_stale()  # servers that left or joined; the route then stays for the session

        def forward(tokens: torch.Tensor, directive: Optional[CacheDirective], context: DenoiseContext) -> torch.Tensor:
            self.guard.check(context.steps[0])  # a valid governance halt stops before this step
            scored = rows_to_score(self.client_config.head_rows, context, generation, tokens.shape[1])
            why = self.client_head_reason(context, directive, scored, adapter)
            query = None if why else self.head_query(context, scored, adapter)
            output = self.logits(tokens, session_id, context.steps[0], directive, scored, query, adapter)
            self.head_use.record(isinstance(output, Predictions),
                                 why or "no head server answered (none on the route, or it failed)")
            return output

        yield forward

    def client_head_reason(self, context: DenoiseContext, directive: Optional[CacheDirective],
                           scored: Optional[tuple[int, int]], adapter: Optional[PromptAdapter]) -> Optional[str]:
        """Why this call cannot ask a head server for its predictions (None when it can). A head server answers
        when the sampler takes predictions or a cut (``context.head``), the head scores only the active rows (so
        a server's matrix product is the one this client would compute), a reuse of the activation cache
        recomputes the rows the step reads (otherwise it would read the fill's logits for the others), and no
        adapter corrects the head (a head server holds no adapter's head weights)."""
        if self.client_config.head != "auto":
            return f"ClientConfig.head is {self.client_config.head!r}"
        if context.head is None:
            return "the sampler reads whole logits (experts composed over the whole vocabulary, expert_top_k=0)"
        if scored is None:
            return "head_rows='all' scores every row"
        if directive is not None and not directive.fill and not (
                directive.rows[0] <= scored[0] and scored[1] <= directive.rows[1]):
            return "a cache reuse that does not recompute the rows the step reads"
        if adapter is not None and adapter.head_lora is not None:
            return "the adapter corrects the head, which only this client holds"
        return None

    @staticmethod
    def head_query(context: DenoiseContext, scored: tuple[int, int],
                   adapter: Optional[PromptAdapter] = None) -> HeadQuery:
        """The call's query for a head server: the sampler's, over the scored rows, shifted past an adapter's
        prompt positions (the servers see them as positions; the head never scores them)."""
        query = dataclasses.replace(context.head, scored=scored)
        return query.shifted(adapter.length) if adapter is not None else query

    def denoiser_workers(self, generation: GenerationConfig) -> int:
        """One thread per call in flight: ``staleness + 1`` round trips overlap, and up to ``staleness`` calls of
        overturned guesses may still be running (they cannot be recalled) without delaying the new ones."""
        return 2 * generation.staleness + 1

    def _use_push(self, enabled: bool) -> None:
        """Register this client's delivery handler the first time push is used."""
        if enabled and self._receiver is None:
            self._receiver = PushReceiver(str(self.dht.peer_id))
            self.loop.run(self._receiver.register(self.p2p))
        self.sequence.receiver = self._receiver if enabled else None

    def open_experts(self, names: Sequence[str], required: bool) -> tuple[dict[str, RemoteExpert], list[str]]:
        """Servers announcing each expert under ``{prefix}.experts.{name}``, queried alongside the route."""
        return open_remote_experts(
            names, dht=self.dht, prefix=self.prefix, backbone=CompatibilityTag.of(self.config, self.tokenizer),
            caller=self.caller, loop=self.loop, health=self.sequence.health, config=self.client_config,
            required=required,
        )

    def generate_stream(self, prompt: str | Sequence[int], *, scale: str = "auto",
                        **kwargs: Any) -> Iterator[StreamChunk]:
        """As :meth:`BaseDiffusionLM.generate_stream`; ``scale="local"`` runs in this process alone."""
        if check_scale(scale) != "local":
            yield from super().generate_stream(prompt, scale=scale, **kwargs)
            return
        for chunk in self.local_model().generate_stream(prompt, scale="local", **kwargs):
            if chunk.result is not None:
                chunk.result.info.update(route=["local"], failovers=[], spot_checks=[], unchecked=0)
            yield chunk

    def local_model(self) -> DiffusionLM:
        """The whole model in this process, for ``scale="local"``: only when the checkpoint has every block."""
        if self._local is None:
            missing = self.missing_blocks()
            if missing:
                raise ValueError(f"scale='local' needs every block's weights locally; {self.files.path} lacks "
                                 f"blocks {compress_ranges(missing)}")
            self._local = DiffusionLM(self.files.full_model(self.client_config.dtype), self.tokenizer, self.files.path,
                                      self.client_config.head_rows)
            self._local.limits = self.limits  # the same request bounds as this client
        return self._local

    def missing_blocks(self) -> list[int]:
        """Blocks whose weights this client's checkpoint lacks (those of a checkpoint fetched for its embedding)."""
        return [i for i in range(self.config.num_layers) if not self.files.reader.has(f"blocks.{i}.attn_norm.weight")]

    def begin_request(self, prompt: str | Sequence[int], prompt_ids: Sequence[int], tier: Optional[str],
                      plan: ScalePlan) -> dict[str, Any]:
        """Classify the safety tier and apply its policy: spot-check fraction, trusted servers only."""
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(list(prompt_ids))
        tier = self.tier_rules.classify(text, tier)
        policy = self.tier_rules.policies[tier]
        if policy.trusted_only and not self.client_config.trusted_peers:
            raise ValueError(f"a {tier} request may only use trusted servers: set ClientConfig.trusted_peers")
        fraction = max(self.client_config.spot_check_fraction, policy.spot_check_fraction, plan.spot_check_fraction)
        allowed = frozenset(self.client_config.trusted_peers) if policy.trusted_only else self.only_peers
        self.sequence.apply_policy(fraction, allowed, require_verified=policy.require_verified)
        self._spot_checks_seen = len(self.sequence.spot_checker.outcomes)
        self._failovers_seen = len(self.sequence.failovers)
        self.head_use.reset()
        return {"tier": tier}

    def run_info(self) -> dict[str, Any]:
        outcomes = self.sequence.spot_checker.outcomes[self._spot_checks_seen:]
        return {"route": [str(hop) for hop in self.planner.route],
                "approximate": self.approximate_hops(),
                "failovers": [vars(event) for event in self.sequence.failovers[self._failovers_seen:]],
                "spot_checks": [outcome.to_dict() for outcome in outcomes],
                "unchecked": self.sequence.spot_checker.unchecked,
                "distrusted": sorted(self.sequence.distrusted),
                "audit_failed": sorted(self.sequence.health.audit_failed),
                "audit_overclaimed": {peer: round(ratio, 2) for peer, ratio in
                                      sorted(self.planner.overclaimed.items())},
                "head": self.head_use.to_dict()}

    def finish_request(self, result) -> None:
        self.audit.write({"prefix": self.prefix, "prompt_tokens": len(result.prompt_ids),
                          "tier": result.info.get("tier"),
                          "route": result.info.get("route"), "failovers": result.info.get("failovers"),
                          "spot_checks": result.info.get("spot_checks"), "halt": result.info.get("halt"),
                          "finish_reason": result.finish_reason, "steps": result.steps})
        if self.client_config.evidence_auditors and (self._handing is None or self._handing.done()):
            auditors = list(self.client_config.evidence_auditors)
            self._handing = asyncio.run_coroutine_threadsafe(self._hand_sample(auditors), self.loop.loop)

    def approximate_hops(self) -> list[str]:
        """Hops of the current route on servers whose numerics differ from the checkpoint's, with what differs
        (only ever non-empty when ``ClientConfig.allow_approximate`` let the route use them)."""
        servers = self.planner.servers
        return [f"{hop}: {servers[hop.peer_id].numerics}" for hop in self.planner.route
                if hop.peer_id in servers and servers[hop.peer_id].approximate]

    # ----- adapters ---------------------------------------------------------------------------------
    adapter_cache: Optional[Path] = None  # where fetched adapters are kept (default: $SWARM_ADAPTER_CACHE or ~/.cache)

    def load_adapter(self, name_or_path: Optional[str]) -> Optional[PromptAdapter]:
        """As :meth:`BaseDiffusionLM.load_adapter`; ``best:TASK`` is first resolved to the published adapter with the
        best score on TASK by a trusted auditor (:meth:`best_adapter`), re-read with the server list."""
        if isinstance(name_or_path, str) and name_or_path.startswith(BEST):
            name_or_path = self.best_adapter(name_or_path[len(BEST):])
        return super().load_adapter(name_or_path)

    def auto_adapter(self, domains: Sequence[str]) -> Optional[str]:
        """For ``experts="auto"``: the best adapter a trusted auditor scored on the first of ``domains`` that it scores
        adapters on (``best:TASK``; the reports read with the server list), or None (no trusted auditor, or no trusted
        score on those domains)."""
        book = self.planner.audits
        if book is None or not book.enabled:
            return None
        self.planner.refresh_if_stale()  # the reports are read with the server list, before the first route too
        scored = {task for _, task in book.adapter_scores()}
        for task in (domain for domain in domains if domain in scored):
            try:
                return self.best_adapter(task)
            except AdapterError as error:
                logger.debug("experts='auto': no audited adapter for %s: %s", task, error)
        return None

    def best_adapter(self, task: str) -> str:
        """``name@AUTHOR@VERSION`` of the published adapter version to use for ``task``: chosen by the scores of the
        auditors this client trusts (publishers' own claims play no part), moving from the version held only when a
        trusted audit measured another better by ``adoption_margin`` (``swarm.reports.adoption``), among the publishers
        of ``trusted_publishers`` when set; :class:`AdapterError` when no trusted auditor scored one. Resolved again
        after ``route_refresh`` seconds (the choice is in ``best_adapters``)."""
        held = self.best_adapters.get(task)
        if held is not None and time.monotonic() - held[0] <= self.client_config.route_refresh:
            return held[1]
        book = self.planner.audits
        if book is None or not book.enabled:
            raise AdapterError(f"adapter='{BEST}{task}' picks by trusted auditors' scores, and this client trusts no "
                               "auditor: set trusted_auditors (or governance keys)")
        self.planner.refresh_if_stale()  # the reports are read with the server list (route_refresh), not again
        publishers = frozenset(self.client_config.trusted_publishers)
        found = choose(book, task, published_versions(self.dht, self.prefix, MAX_CATALOG_NAMES, publishers),
                       held[2] if held is not None else None, self.client_config.adoption_margin,
                       frozenset(self.client_config.trusted_publishers))
        if found is None:
            raise AdapterError(f"adapter='{BEST}{task}': no published adapter has a score on {task!r} by a trusted "
                               "auditor (python -m swarm.health --trusted-auditors KEY lists the scores)")
        reference, score = reference_of(found.record), found.score
        if held is None or held[1] != reference:
            logger.info("adapter %s%s is %s: %d/%d held-out problems exact by auditor %s... (publisher claims %s)%s",
                        BEST, task, reference, score.correct, score.examples, found.auditor[:12], found.record.score,
                        f"; moved from {held[1]}" if held is not None else "")
        self.best_adapters[task] = (time.monotonic(), reference, found.record.sha256)
        return reference

    def find_adapter(self, name_or_path: str, base: dict[str, Any]) -> PromptAdapter:
        """An adapter directory, or else a name published on the swarm (``name`` or ``name@AUTHOR``), fetched
        from a peer that serves it and checked against its signed record (docs/TRAINING.md, 'Sharing adapters')."""
        if Path(name_or_path).is_dir() or "/" in name_or_path:  # a path (a missing one is refused as such)
            return PromptAdapter.load(name_or_path, base)

        directory = fetch_reference(self.dht, self.prefix, name_or_path, base,
                                    self.adapter_cache or default_cache_dir(), self._fetch_adapter_files)
        return PromptAdapter.load(directory, base)

    def _fetch_adapter_files(self, peer_id: str, addresses: list[str], sha256: str, max_bytes: int
                             ) -> dict[str, bytes]:
        """One host's adapter files (dialing the addresses it announced if the daemon cannot reach it); a failed
        call is an :class:`AdapterError`, so that the next host is tried."""
        timeout = self.client_config.request_timeout

        fetch = self.caller.dialing(peer_id, addresses, self.client_config.connect_timeout,
                                    lambda: self.caller.adapter_files(peer_id, sha256, max_bytes, timeout))
        try:
            return self.loop.run(fetch, timeout=2 * timeout + self.client_config.connect_timeout + 5)
        except RemoteError as error:
            raise AdapterError(str(error)) from error

    # ----- audits of real traffic (docs/AUDIT.md, "Receipts and proofs") -----------------------------
    def private_calls(self) -> contextlib.AbstractContextManager[None]:
        """Calls made inside are never kept for auditors (their hidden states show the prompt)."""
        return self.receipts.private()

    def audit_sample(self) -> list[CallEvidence]:
        """The sampled calls (``ClientConfig.audit_share``) with their receipts: evidence to hand to an auditor,
        who recomputes each (``swarm.client.proofs.verify_evidence``)."""
        return self.receipts.sample()

    def save_audit_sample(self, directory: str | Path) -> list[Path]:
        """Write :meth:`audit_sample` as ``*.evidence`` files in ``directory`` (for an auditor's ``--evidence-dir``)
        and forget them here; the paths written."""
        paths = save_sample(self.audit_sample(), Path(directory))
        self.receipts.clear_sample()
        return paths

    def hand_audit_sample(self, auditors: Optional[Sequence[str]] = None) -> dict[str, int]:
        """Hand :meth:`audit_sample` (a random choice of :data:`~swarm.wire.handoff.MAX_PER_HANDOFF` of it) to each
        auditor (peer ids; default ``ClientConfig.evidence_auditors``) over libp2p now, each piece with a work stamp
        (:mod:`swarm.wire.handoff`), and forget the sample here; per auditor, the pieces it queued. With
        ``evidence_auditors`` set this happens in the background after every generation; this waits for such a
        hand-off in flight first. An auditor that refuses or cannot be reached is logged, never raised: the sample
        is the client's to share, not a condition of its generations."""
        auditors = list(self.client_config.evidence_auditors if auditors is None else auditors)
        handing = self._handing
        if handing is not None:
            with contextlib.suppress(Exception):  # logged where it failed
                handing.result(timeout=MAX_PER_HANDOFF * (self.client_config.request_timeout + 60))
        return self.loop.run(self._hand_sample(auditors))

    async def _hand_sample(self, auditors: list[str]) -> dict[str, int]:
        sample = self.audit_sample()
        sample = [evidence.to_bytes() for evidence in random.SystemRandom().sample(
            sample, min(len(sample), MAX_PER_HANDOFF))]
        queued = dict.fromkeys(auditors, 0)
        if not sample or not auditors:
            return queued
        self.receipts.clear_sample()  # taken: the calls from now on make the next sample
        timeout = self.client_config.request_timeout
        for auditor in auditors:
            for data in sample:
                try:
                    await hand_evidence(self.p2p, auditor, data, True, timeout)
                    queued[auditor] += 1
                except RemoteError as error:
                    logger.warning("auditor %s did not take a sampled call: %s", auditor, error)
                    if error.code not in (ErrorCode.BAD_REQUEST, ErrorCode.TOO_LARGE):
                        break  # unreachable or busy: the rest would fare the same now
        logger.info("handed %d sampled calls: %s", len(sample), queued)
        return queued

    @property
    def proofs(self) -> list[CallEvidence]:
        """Signed wrong answers this client's spot checks caught: proofs anyone holding the blocks can verify."""
        return list(self.sequence.spot_checker.proofs)

    def accept_proof(self, evidence: CallEvidence) -> Finding:
        """Recompute ``evidence`` (somebody's proof) on this client's checkpoint and avoid the accused server when
        the proof holds: on the recomputation, never on the prover's word. ValueError when this client cannot
        recompute (its checkpoint lacks blocks, or it computes in other numerics)."""
        reference = self.sequence.spot_checker.reference
        if reference is None:
            raise ValueError("this client cannot recompute calls (its checkpoint lacks blocks or it computes in other "
                             "numerics): ask an auditor that holds them")
        finding = verify_evidence(evidence, reference, self.prefix, self.config, self.client_config.spot_check_rtol)
        if finding.verdict == Verdict.LIE:
            self.sequence.health.distrust(finding.accused, f"proven wrong answer: {finding.reason}")
            self.planner.route = []
        else:
            logger.info("a proof against %s does not hold (%s): %s", evidence.accused, finding.verdict.value,
                        finding.reason)
        return finding

    # ----- route and lifecycle ----------------------------------------------------------------------
    def show_route(self) -> list[RouteHop]:
        """Build (if needed) and log the current route; returns its hops."""
        route = self.planner.route or self.planner.build_route()
        logger.info("route over %s: %s", plural(len(route), "server"), " -> ".join(map(str, route)))
        return list(route)

    def shutdown(self) -> None:
        """Stop the DHT peer and its P2P connection if this client started them (a shared DHT stays up, and so does
        this client's connection to its daemon, which every client of that DHT shares: ``stop_dht`` of that DHT
        closes it). A hand-off of the sample in flight gets :data:`HANDOFF_GRACE_S` to finish."""
        handing, self._handing = self._handing, None
        if handing is not None and not handing.done():
            with contextlib.suppress(Exception):  # cut short, or failed: logged where it failed
                handing.result(timeout=HANDOFF_GRACE_S)
            handing.cancel()
        if self._own_dht:
            stop_dht(self.dht)  # closes this client's connection to its daemon first

    def __enter__(self) -> "DistributedDiffusionLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
