"""What one sampler step reads from a state's logits, computed wherever the logits are.

A step reads, for each position of the state's active block, four numbers only: the predicted token x0 (the
argmax, or with a temperature a Gumbel-max draw from the step's seeded noise) and the three confidences the
remasking strategies rank by (the probability of x0, the margin between the two most likely tokens, minus
the entropy). :func:`predict_block` computes them in float64 from the block's logits. The local sampler calls
it on its own logits; a server that holds the output head (``--head``) calls the same function on the same
logits and answers these numbers (a :class:`HeadQuery` says for which rows, steps and settings) instead of
hidden states: at LLaDA-8B's widths, 32 bytes per row instead of a 126464-wide head on the client. Same
inputs through the same code give the same numbers, so the tokens equal the local run's.

With experts composed (``expert_top_k`` = k > 0) the sampler reads logits, which the experts' scores move: a head
server then answers each state's block as its k most likely tokens after guidance (:func:`sparse_states`, the
backbone cut as the experts are, :mod:`swarm.diffusion.sparse`), float64 rows of k ids, k log-probabilities and
the rest's mass (``2k + 1`` columns), so the client composes them without a head of its own; the local sampler cuts
its own logits the same way (:func:`cut_to_top_k`), so the tokens stay the same. A cut call's logits are a
:class:`CutLogits`: each state's block over the named ids, every other token at one shared value per position
(:mod:`swarm.diffusion.union`), and every function below has a closed form over them.

Noise comes from two streams per (seed, step): the remasking draws (``random`` order), which the client
needs, and the Gumbel noise for x0, which only the side computing x0 draws (a block x vocabulary of it; over a cut
block, m + 2 per position for m named ids: :func:`~swarm.diffusion.union.sample_tokens`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from swarm.diffusion.config import MAX_EXPERT_TOP_K, MAX_STALENESS
from swarm.diffusion.sparse import SparseScores, block_log_probs
from swarm.diffusion.union import UnionScores, greedy_tokens, predict_union, probabilities, sample_tokens, without_token

if TYPE_CHECKING:
    from swarm.models.modules import OutputHead

PREDICTION_FIELDS = ("token", "probability", "margin", "negative_entropy")
"""The columns of a prediction row (float64; the token id is exact in float64)."""
MARGIN_COLUMN = PREDICTION_FIELDS.index("margin")

REMASKING_STREAM, GUMBEL_STREAM = 0, 1


def step_generator(seed: int, step: int, stream: int = REMASKING_STREAM) -> torch.Generator:
    """A generator whose draws depend only on (seed, step, stream)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + stream * 0xD6E8FEB86659FD93
             + 0x94D049BB133111EB) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


def step_uniform(seed: int, step: int, rows: int) -> torch.Tensor:
    """The step's remasking draws in [0, 1), one per block position (the ``random`` strategy's order)."""
    return torch.rand(rows, generator=step_generator(seed, step, REMASKING_STREAM), dtype=torch.float64)


BlockScores = Union[torch.Tensor, UnionScores]
"""A block's float64 scores: whole rows (positions, vocab), or over named ids and one shared value (a cut call)."""


def predict_tokens(scores: BlockScores, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """Each position's token: the argmax, or with ``temperature`` > 0 a Gumbel-max draw from ``generator`` (over a
    cut block, the same distribution drawn over the named ids and the rest:
    :func:`~swarm.diffusion.union.sample_tokens`)."""
    if isinstance(scores, UnionScores):
        return greedy_tokens(scores) if temperature <= 0 else sample_tokens(scores, temperature, generator)
    if temperature <= 0:
        return scores.argmax(-1)
    uniform = torch.rand(scores.shape, generator=generator, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(uniform.clamp(1e-300, 1.0 - 1e-16)))
    return (scores + temperature * gumbel).argmax(-1)


def masked_scores(logits: BlockScores, mask_token_id: int) -> BlockScores:
    """Float64 scores of some positions' logits; a position is never "unmasked" to the mask token."""
    if isinstance(logits, UnionScores):
        return without_token(logits.map(torch.Tensor.double), mask_token_id)
    scores = logits.double()
    scores[..., mask_token_id] = float("-inf")
    return scores


def guided(logits: torch.Tensor, states: int, cfg_scale: float) -> torch.Tensor:
    """Classifier-free guidance over a batch of ``states`` conditional rows followed by their unconditional
    copies (unchanged when ``cfg_scale`` is 0)."""
    if cfg_scale <= 0:
        return logits
    cond, uncond = logits[:states], logits[states:]
    return uncond + (cfg_scale + 1) * (cond - uncond)


def predict_block(scores: BlockScores, temperature: float, seed: int, step: int) -> torch.Tensor:
    """(positions, 4) float64 rows of :data:`PREDICTION_FIELDS` from (positions, vocab) float64 scores (or their
    closed forms over a cut block's named ids)."""
    x0 = predict_tokens(scores, temperature, step_generator(seed, step, GUMBEL_STREAM))
    if isinstance(scores, UnionScores):
        return predict_union(scores, x0)
    probs = torch.softmax(scores, dim=-1)
    probability = probs.gather(-1, x0[:, None]).squeeze(-1)
    top2 = probs.topk(2, dim=-1).values
    negative_entropy = (probs * probs.clamp_min(1e-300).log()).sum(-1)
    return torch.stack([x0.double(), probability, top2[:, 0] - top2[:, 1], negative_entropy], dim=-1)


def token_probabilities(scores: BlockScores, tokens: torch.Tensor) -> torch.Tensor:
    """The softmax probability of ``tokens[i]`` at position i of a block's float64 scores."""
    if isinstance(scores, UnionScores):
        return probabilities(scores).at(tokens.unsqueeze(-1)).squeeze(-1)
    return torch.softmax(scores, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class HeadQuery:
    """What a head server needs to answer predictions instead of hidden states, for one denoiser call.

    The batch holds ``len(block_starts)`` states (and, with guidance, their unconditional copies after them);
    state i is predicted over its active block ``block_starts[i]:+block_length`` with the noise of
    ``steps[i]``. ``scored`` is the range of absolute positions whose logits are computed, exactly as the
    local model's head computes them (:func:`swarm.diffusion.pipeline.scored_rows`), so that the matrix
    product, and hence every number, is the same. With ``ahead`` = a > 0 each block is also predicted with the
    noise of the a steps after ``steps[i]``: a stale step (``staleness``) decides on an older state's answer
    with its own step's noise, as the local sampler draws it from that state's logits.
    """

    block_starts: tuple[int, ...]
    block_length: int
    steps: tuple[int, ...]
    seed: int
    temperature: float
    cfg_scale: float
    mask_token_id: int
    scored: tuple[int, int] = (0, 0)
    top_k: int = 0  # above 0: answer each block's top k after guidance (experts compose on the client), not predictions
    ahead: int = 0  # predictions with the noise of this many later steps too (columns: see prediction_columns)

    @property
    def states(self) -> int:
        return len(self.block_starts)

    @property
    def batch(self) -> int:
        """Rows of hidden states the call carries: the states, and their unconditional copies with guidance."""
        return self.states * (2 if self.cfg_scale > 0 else 1)

    @property
    def output_shape(self) -> tuple[int, int, int]:
        width = 2 * self.top_k + 1 if self.top_k else len(PREDICTION_FIELDS) * (1 + self.ahead)
        return self.states, self.block_length, width

    def shifted(self, rows: int) -> "HeadQuery":
        """The same query over a sequence with ``rows`` more positions in front (an adapter's prompt positions,
        which the servers see as positions and the head never scores): the same rows, so the same numbers."""
        if rows == 0:
            return self
        return dataclasses.replace(self, block_starts=tuple(s + rows for s in self.block_starts),
                                   scored=(self.scored[0] + rows, self.scored[1] + rows))

    def to_dict(self) -> dict[str, Any]:
        """The request metadata a head server reads (``extra["head"]``)."""
        return {"block_starts": list(self.block_starts), "block_length": self.block_length,
                "steps": list(self.steps), "seed": self.seed, "temperature": self.temperature,
                "cfg_scale": self.cfg_scale, "mask_token_id": self.mask_token_id, "scored": list(self.scored),
                **({"top_k": self.top_k} if self.top_k else {}), **({"ahead": self.ahead} if self.ahead else {})}

    @classmethod
    def parse(cls, value: Any, batch: int, length: int, vocab_size: int, first: int = 0) -> "HeadQuery":
        """A query from remote metadata, checked against the call it comes with (``length`` positions from
        position ``first``: a reuse of the activation cache sends only rows ``first:first + length``); ValueError
        says what is wrong."""
        if not isinstance(value, dict):
            raise ValueError("extra['head'] must be a map")
        starts, steps, scored = value.get("block_starts"), value.get("steps"), value.get("scored")
        block_length, seed, mask = value.get("block_length"), value.get("seed"), value.get("mask_token_id")
        temperature, cfg_scale = value.get("temperature"), value.get("cfg_scale")
        if not (_int_list(starts) and _int_list(steps) and _int_list(scored) and len(scored) == 2):
            raise ValueError("head block_starts, steps and scored must be lists of integers (scored: [start, end])")
        if not all(_is_int(v) for v in (block_length, seed, mask)):
            raise ValueError("head block_length, seed and mask_token_id must be integers")
        if not all(_is_number(v) and 0 <= v <= 1e6 for v in (temperature, cfg_scale)):
            raise ValueError("head temperature and cfg_scale must be finite numbers >= 0")
        top_k = value.get("top_k", 0)
        if not _is_int(top_k) or not 0 <= top_k <= min(MAX_EXPERT_TOP_K, vocab_size):
            raise ValueError(f"head top_k must be an integer in [0, {min(MAX_EXPERT_TOP_K, vocab_size)}]")
        ahead = value.get("ahead", 0)
        if not _is_int(ahead) or not 0 <= ahead <= MAX_STALENESS or (ahead and top_k):
            raise ValueError(f"head ahead must be an integer in [0, {MAX_STALENESS}], and 0 with top_k")
        query = cls(tuple(starts), block_length, tuple(steps), seed, float(temperature), float(cfg_scale), mask,
                    (scored[0], scored[1]), top_k, ahead)
        if not starts or len(steps) != len(starts) or query.batch != batch:
            raise ValueError(f"head query for {len(starts)} states (guidance {cfg_scale}) with {len(steps)} steps "
                             f"does not match a batch of {batch}")
        if not first <= scored[0] < scored[1] <= first + length or not 0 < block_length <= length:
            raise ValueError(f"head rows {scored} or block length {block_length} do not fit positions "
                             f"{first}:{first + length}")
        if any(not scored[0] <= s or s + block_length > scored[1] for s in starts):
            raise ValueError(f"head blocks {list(starts)} of length {block_length} are not inside the scored rows "
                             f"{scored[0]}:{scored[1]}")
        if not 0 <= mask < vocab_size or not all(0 <= s < 2**31 for s in steps) or not 0 <= seed < 2**63:
            raise ValueError("head mask_token_id, steps or seed out of range")
        return query


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= 4096 and all(_is_int(v) for v in value)


def predict_states(logits: torch.Tensor, query: HeadQuery) -> torch.Tensor:
    """The answer to ``query`` from the float32 logits of its scored rows (batch, scored rows, vocab):
    guidance applied, then each state's block predicted with its step's noise (or, with ``query.top_k``, cut to
    its top k: :func:`sparse_states`)."""
    logits = guided(logits, query.states, query.cfg_scale)
    if query.top_k:
        return sparse_states(logits, query)
    out = torch.empty(query.output_shape, dtype=torch.float64)
    for i, (start, step) in enumerate(zip(query.block_starts, query.steps)):
        first = start - query.scored[0]
        scores = masked_scores(logits[i, first:first + query.block_length], query.mask_token_id)
        by_step = prediction_columns(out[i])
        for later in range(1 + query.ahead):
            by_step[:, :, later] = predict_block(scores, query.temperature, query.seed, step + later)
    return out


def prediction_columns(rows: torch.Tensor) -> torch.Tensor:
    """A prediction answer's rows (..., 4 x (1 + ahead)) as a view (..., field, step): the columns hold each
    :data:`PREDICTION_FIELDS` entry for every step in turn (tokens first), so the leading columns are the tokens,
    the numbers two honest head servers agree on exactly (:func:`exact_columns`)."""
    return rows.unflatten(-1, (len(PREDICTION_FIELDS), rows.shape[-1] // len(PREDICTION_FIELDS)))


def sparse_states(guided_logits: torch.Tensor, query: HeadQuery) -> torch.Tensor:
    """Each state's block, after guidance, as its ``query.top_k`` most likely tokens: float64 rows of k ids, k
    log-probabilities and the rest's log-mass (exact in float64), from the same numbers the client would cut."""
    out = torch.empty(query.output_shape, dtype=torch.float64)
    k = query.top_k
    for i, start in enumerate(query.block_starts):
        first = start - query.scored[0]
        cut = SparseScores.top_k(block_log_probs(guided_logits[i:i + 1], first, first + query.block_length), k)
        out[i, :, :k] = cut.ids[0].double()
        out[i, :, k:2 * k] = cut.log_probs[0].double()
        out[i, :, 2 * k] = cut.rest[0].double()
    return out


def unpack_sparse(rows: torch.Tensor, vocab_size: int) -> SparseScores:
    """A head server's sparse answer (..., 2k + 1) float64 as :class:`SparseScores` (ValueError if it is not one)."""
    if rows.dtype != torch.float64 or rows.dim() < 1 or rows.shape[-1] % 2 != 1:
        raise ValueError(f"a sparse answer has 2k + 1 float64 columns, got {tuple(rows.shape)} ({rows.dtype})")
    k = rows.shape[-1] // 2
    ids = rows[..., :k]
    if not bool(torch.isfinite(ids).all()) or not bool((ids == ids.round()).all()):
        raise ValueError("token ids that are not integers")
    return SparseScores(ids.clamp(-1, 2**31).long(), rows[..., k:2 * k].float(), rows[..., 2 * k].float(), vocab_size)


def exact_columns(rows: torch.Tensor) -> int:
    """How many leading columns of a head server's float64 answer must match exactly between two servers: the
    tokens of a prediction row (one per step, :func:`prediction_columns`), the k ids of a sparse one (2k + 1
    columns: odd, where a prediction row has a multiple of 4)."""
    width = rows.shape[-1]
    return width // len(PREDICTION_FIELDS) if width % len(PREDICTION_FIELDS) == 0 else width // 2


@dataclass(frozen=True)
class StateCut:
    """One state's logits at k > 0: its block from ``block_start``, over the named ids (``scores``: (positions, m)
    :class:`~swarm.diffusion.union.UnionScores`); nothing is known about the other positions."""

    block_start: int
    scores: UnionScores

    def covers(self, start: int, end: int) -> bool:
        return self.block_start == start and self.scores.ids.shape[0] == end - start


class CutLogits:
    """A call's logits when the backbone is cut to its top k (experts at ``expert_top_k`` > 0): one
    :class:`StateCut` per state, indexable like logits. The local sampler's path (:func:`cut_to_top_k`) and the
    remote one (:meth:`Predictions.cut`) meet here, and the composition rewrites its blocks (:func:`write_block`)."""

    def __init__(self, states: Sequence[StateCut]):
        self.states = list(states)

    @classmethod
    def from_sparse(cls, cut: SparseScores, block_starts: Sequence[int]) -> "CutLogits":
        """State i's block from row i of ``cut`` (states, positions, k)."""
        union = UnionScores.from_sparse(cut)
        return cls([StateCut(start, union.rows(i)) for i, start in enumerate(block_starts)])

    def dense(self, length: int) -> torch.Tensor:
        """(states, length, vocab) float32, NaN outside the blocks: the whole rows the closed forms stand for."""
        vocab = self.states[0].scores.vocab_size
        out = torch.full((len(self.states), length, vocab), float("nan"), dtype=torch.float32)
        for i, state in enumerate(self.states):
            out[i, state.block_start:state.block_start + len(state.scores.ids)] = state.scores.dense()
        return out

    def clone(self) -> "CutLogits":
        return CutLogits(self.states)  # StateCut is frozen: replacing one never changes the original

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, index: int) -> StateCut:
        return self.states[index]


CallLogits = Union[torch.Tensor, CutLogits]
"""A call's logits: whole rows (states, length, vocab), or each state's block cut to the named ids."""


def read_block(logits: CallLogits, row: int, start: int, end: int) -> Union[torch.Tensor, UnionScores]:
    """State ``row``'s positions ``start:end`` as a batch of one."""
    if isinstance(logits, CutLogits):
        state = logits[row]
        if not state.covers(start, end):
            raise ValueError(f"state {row} was cut at block {state.block_start}, not {start}:{end}")
        return state.scores.rows((None,))
    return logits[row:row + 1, start:end]


def write_block(logits: CallLogits, row: int, start: int, values: Union[torch.Tensor, UnionScores]) -> None:
    """Replace state ``row``'s block from ``start`` by ``values`` (a batch of one, as :func:`read_block` gives)."""
    if isinstance(logits, CutLogits):
        logits.states[row] = StateCut(start, values.rows(0))
    else:
        logits[row, start:start + values.shape[1]] = values[0].to(logits.dtype)


def cut_to_top_k(logits: torch.Tensor, blocks: Sequence[tuple[int, int]], top_k: int) -> CutLogits:
    """What a head server's sparse answer gives the client (:meth:`Predictions.cut`), from guided logits (states,
    length, vocab): each state's block as its top k, every other token at its share of the rest."""
    return CutLogits([StateCut(start, UnionScores.from_sparse(
        SparseScores.top_k(block_log_probs(logits[i:i + 1], start, end), top_k)).rows(0))
        for i, (start, end) in enumerate(blocks)])


def predict_from_hidden(head: "OutputHead", hidden: torch.Tensor, query: HeadQuery) -> torch.Tensor:
    """The answer a head server owes ``query`` for the hidden states after the last block (batch, length, hidden):
    the computation a head server runs (final norm and head over the scored rows, then :func:`predict_states`),
    here for a client that checks a head server's predictions against another server's hidden states."""
    dtype = next(head.parameters()).dtype
    with torch.no_grad():
        logits = head.scored_logits(hidden.to(dtype), 0, query.scored)
    return predict_states(logits.cpu(), query)


def check_predictions(predictions: torch.Tensor, query: HeadQuery, vocab_size: int) -> Optional[str]:
    """What is wrong with a head server's answer, or None: the shape, finite values, token ids in the
    vocabulary and not the mask, probabilities and margins in [0, 1], negative entropies <= 0 (for a sparse
    answer, :meth:`SparseScores.check`)."""
    if tuple(predictions.shape) != query.output_shape or predictions.dtype != torch.float64:
        return f"predictions of shape {tuple(predictions.shape)} ({predictions.dtype}), expected {query.output_shape}"
    if query.top_k:
        try:
            unpack_sparse(predictions, vocab_size).check(query.output_shape[:2], query.top_k)
        except ValueError as error:
            return f"a sparse answer refused: {error}"
        return None
    if not bool(torch.isfinite(predictions).all()):
        return "predictions with non-finite values"
    tokens, probability, margin, negative_entropy = prediction_columns(predictions).unbind(-2)
    if not (bool((tokens == tokens.round()).all()) and bool(((tokens >= 0) & (tokens < vocab_size)).all())
            and not bool((tokens == query.mask_token_id).any())):
        return "predicted tokens that are not vocabulary ids (or are the mask)"
    in_unit = ((probability >= 0) & (probability <= 1) & (margin >= 0) & (margin <= 1)).all()
    if not bool(in_unit) or not bool((negative_entropy <= 1e-9).all()):
        return "predicted probabilities, margins or entropies out of range"
    return None


@dataclass(frozen=True)
class StatePrediction:
    """One state's predictions, as a head server answered them: for the block starting at ``block_start``, rows
    of :data:`PREDICTION_FIELDS` drawn with the noise of ``step`` and of the query's ``ahead`` later steps."""

    block_start: int
    step: int
    rows: torch.Tensor

    def at(self, step: int) -> torch.Tensor:
        """The rows drawn with ``step``'s noise; for a step not drawn, ``self.step``'s (a Picard window's cheap
        tail guesses use them in place of re-drawn noise)."""
        by_step = prediction_columns(self.rows)
        later = step - self.step
        return by_step[:, :, later if 0 <= later < by_step.shape[-1] else 0]


class Predictions:
    """A call's answer from a head server: one :class:`StatePrediction` per state (indexable like logits), or with
    ``query.top_k`` each state's block cut to its top k (:meth:`logits`)."""

    def __init__(self, rows: torch.Tensor, query: HeadQuery, vocab_size: int = 0):
        self.rows = rows  # (states, block length, fields) float64, as the server answered
        self.query = query
        self.vocab_size = vocab_size  # a sparse answer's vocabulary (checked against it)
        self.states = [StatePrediction(start, step, rows[i])
                       for i, (start, step) in enumerate(zip(query.block_starts, query.steps))]

    @property
    def sparse(self) -> bool:
        return self.query.top_k > 0

    def cut(self) -> CutLogits:
        """A sparse answer as :func:`cut_to_top_k` gives it locally."""
        return CutLogits.from_sparse(unpack_sparse(self.rows, self.vocab_size), self.query.block_starts)

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, index: int) -> StatePrediction:
        return self.states[index]


StateScores = Union[torch.Tensor, StatePrediction, StateCut]
"""What a step decides from: one state's logits (length, vocab), its block cut, or a head server's predictions."""


def covers(scores: StateScores, start: int, end: int) -> bool:
    """Whether ``scores`` say anything about positions ``start:end`` (a state's logits do about every position; a
    cut block or a head server's predictions only about their own block)."""
    if isinstance(scores, StatePrediction):
        return scores.block_start == start and len(scores.rows) == end - start
    return scores.covers(start, end) if isinstance(scores, StateCut) else True


def block_slice(scores: torch.Tensor | StateCut, start: int, end: int) -> BlockScores:
    """Positions ``start:end`` of one state's logits or of its cut block (which must be that block)."""
    return scores.scores if isinstance(scores, StateCut) else scores[start:end]


def block_prediction(scores: StateScores, start: int, end: int, step: int, temperature: float,
                     seed: int, mask_token_id: int) -> Optional[torch.Tensor]:
    """Prediction rows of positions ``start:end`` at ``step``: computed from one state's logits (length, vocab) or
    its cut block, or taken from a head server's answer. Scores for another block are of no use (None); an answer
    drawn for another step is what the sampler's cheap guesses (a Picard window's tail) use in place of re-drawn
    noise."""
    if not covers(scores, start, end):
        return None
    if isinstance(scores, StatePrediction):
        return scores.at(step)
    return predict_block(masked_scores(block_slice(scores, start, end), mask_token_id), temperature, seed, step)

