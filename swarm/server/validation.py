"""Checks on every remote request before any compute. Raise RemoteError, never assert."""
from __future__ import annotations

from typing import Any

import torch

from swarm.adapters.adapter import max_block_rows  # the adapters' own limits
from swarm.adapters.block import BlockAdapter, check_rows, is_sha256_hex
from swarm.adapters.kinds import DEEP_PROMPT, PER_BLOCK_KINDS, described
from swarm.adapters.lora import BlockWidths
from swarm.diffusion.pipeline import CacheDirective
from swarm.wire.messages import ErrorCode, RemoteError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT_DTYPE_NAMES = ("float32", "float16", "bfloat16")
MAX_SESSION_ID_LENGTH = 128


def require(condition: bool, code: ErrorCode, message: str) -> None:
    if not condition:
        raise RemoteError(code, message)


def validate_metadata(metadata: dict[str, Any], held: tuple[int, int]) -> tuple[int, int]:
    """The requested span must be inside the held one; ids and counters must have the right types."""
    start, end = metadata.get("start"), metadata.get("end")
    require(isinstance(start, int) and isinstance(end, int), ErrorCode.BAD_REQUEST,
            f"metadata 'start' and 'end' must be integers, got {start!r} and {end!r}")
    require(held[0] <= start < end <= held[1], ErrorCode.WRONG_SPAN,
            f"blocks {start}:{end} requested, this server holds {held[0]}:{held[1]}")
    session_id = metadata.get("session_id", "")
    require(isinstance(session_id, str) and len(session_id) <= MAX_SESSION_ID_LENGTH, ErrorCode.BAD_REQUEST,
            f"session_id must be a string of at most {MAX_SESSION_ID_LENGTH} characters")
    require(isinstance(metadata.get("step", -1), int), ErrorCode.BAD_REQUEST, "step must be an integer")
    require(isinstance(metadata.get("extra", {}), dict), ErrorCode.BAD_REQUEST, "extra must be a map")
    return start, end


def is_count(value: Any) -> bool:
    """A non-negative int that fits 31 bits (msgpack booleans are not counts)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def validate_shape(shape: tuple[int, ...], hidden_size: int, max_batch_tokens: int) -> tuple[int, int]:
    """(batch, length) of hidden states of ``shape``: checked on the declared shape before anything is received
    or decoded, and again on the decoded tensor."""
    require(len(shape) == 3, ErrorCode.BAD_REQUEST,
            f"hidden states must have shape (batch, length, {hidden_size}), got {tuple(shape)}")
    batch, length, size = shape
    require(size == hidden_size, ErrorCode.BAD_REQUEST, f"hidden size {size} does not match the model's {hidden_size}")
    require(batch > 0 and length > 0, ErrorCode.BAD_REQUEST, f"empty batch {tuple(shape)}")
    require(batch * length <= max_batch_tokens, ErrorCode.TOO_LARGE,
            f"{batch} x {length} = {batch * length} tokens exceeds this server's limit of {max_batch_tokens}")
    return batch, length


def validate_positions(length: int, max_positions: int) -> None:
    """A pass is at most the model's context long: beyond it the model is untrained, and attention's cost grows
    with the square of the length (a 16,384-position request once held a server's compute thread for 248 s)."""
    require(length <= max_positions, ErrorCode.TOO_LARGE,
            f"{length} positions exceed the model's context of {max_positions} positions: send at most "
            f"{max_positions} per sequence")


def validate_declared(dtype: str, shape: tuple[int, ...], hidden_size: int, max_batch_tokens: int) -> tuple[int, int]:
    """The dtype and shape a serialized tensor declares, before its bytes are received or decoded."""
    require(dtype in FLOAT_DTYPE_NAMES, ErrorCode.BAD_REQUEST,
            f"hidden states must be {'/'.join(FLOAT_DTYPE_NAMES)}, got {dtype!r}")
    return validate_shape(shape, hidden_size, max_batch_tokens)


def validate_hidden(hidden: torch.Tensor, hidden_size: int, max_batch_tokens: int) -> None:
    require(hidden.dtype in FLOAT_DTYPES, ErrorCode.BAD_REQUEST,
            f"hidden states must be float32/float16/bfloat16, got {hidden.dtype}")
    validate_shape(tuple(hidden.shape), hidden_size, max_batch_tokens)
    require(bool(torch.isfinite(hidden).all()), ErrorCode.NOT_FINITE, "hidden states contain NaN or infinite values")


def validate_prompt_declared(metadata: dict[str, Any], blocks: int, max_batch_tokens: int, widths: BlockWidths
                             ) -> tuple[int, int, str]:
    """(R, parts, kind) of the per-block adapter tensor a request declares ((0, 0, deep_prompt) for none), bounded
    before anything is received: R at most the kind's limit, blocks x R rows at most the positions a request may
    carry, a known kind and an R it can have (a bottleneck's 2 x rank is even, a LoRA's is the packed size of some
    rank for these ``widths``). parts is 0 for a tensor named by a well-formed ``prompt_digest`` instead of sent."""
    length, parts = metadata.get("prompt_length"), metadata.get("prompt_parts")
    kind = metadata.get("prompt_kind", DEEP_PROMPT)
    if length is None and parts is None and "prompt_kind" not in metadata:
        return 0, 0, DEEP_PROMPT
    require(isinstance(kind, str) and kind in PER_BLOCK_KINDS, ErrorCode.BAD_REQUEST,
            f"metadata 'prompt_kind' must be one of {', '.join(PER_BLOCK_KINDS)}, got {kind!r}")
    limit = max_block_rows(kind, widths)
    require(is_count(length) and 0 < length <= limit, ErrorCode.BAD_REQUEST,
            f"metadata 'prompt_length' must be an integer in 1..{limit} for a {kind}, got {length!r}")
    digest = metadata.get("prompt_digest")
    if digest is None:
        require(is_count(parts) and parts > 0, ErrorCode.BAD_REQUEST,
                f"metadata 'prompt_parts' must be a positive integer, got {parts!r}")
    else:  # named by digest (held from an earlier call): no tensor travels
        require(is_sha256_hex(digest), ErrorCode.BAD_REQUEST,
                f"metadata 'prompt_digest' must be 64 lowercase hex digits, got {str(digest)[:80]!r}")
        require(parts is None, ErrorCode.BAD_REQUEST,
                "a request either sends its adapter tensor (prompt_parts) or names it (prompt_digest), not both")
        parts = 0
    require(blocks * length <= max_batch_tokens, ErrorCode.TOO_LARGE,
            f"a {described(kind)} of {length} rows for {blocks} blocks ({blocks * length}) exceeds this "
            f"server's limit of {max_batch_tokens}")
    try:
        check_rows(kind, length, widths)
    except ValueError as error:
        raise RemoteError(ErrorCode.BAD_REQUEST, f"metadata 'prompt_length': {error}") from None
    return length, parts, kind


def validate_adapter(adapter: BlockAdapter, shape: tuple[int, int, int]) -> None:
    """A per-block adapter's weights: float, exactly the declared (blocks, R, hidden), finite."""
    what, weights = adapter.describe(), adapter.weights
    require(weights.dtype in FLOAT_DTYPES, ErrorCode.BAD_REQUEST,
            f"{what} must be float32/float16/bfloat16, got {weights.dtype}")
    require(tuple(weights.shape) == tuple(shape), ErrorCode.BAD_REQUEST,
            f"{what} have shape {tuple(weights.shape)}, the request declares {tuple(shape)}")
    require(bool(torch.isfinite(weights).all()), ErrorCode.NOT_FINITE, f"{what} contain NaN or infinite values")


def parse_cache(directive: Any, session_id: str, length: int) -> CacheDirective:
    """A request's ``extra["cache"]``: fill the session's cache as ``version`` (``rows`` null), or reuse that version
    for rows [a, b], which must be the ``length`` rows sent."""
    require(isinstance(directive, dict) and "rows" in directive, ErrorCode.BAD_REQUEST,
            "extra['cache'] must be a map with 'rows' (null to fill, [start, end] to reuse)")
    version, keep_from = directive.get("version"), directive.get("keep_from", 0)
    require(is_count(version) and is_count(keep_from) and keep_from <= version, ErrorCode.BAD_REQUEST,
            f"cache version and keep_from must be integers with 0 <= keep_from <= version < 2**31, got "
            f"{version!r} and {keep_from!r}")
    require(bool(session_id), ErrorCode.BAD_REQUEST, "a cached request needs a session_id")
    rows = directive["rows"]
    if rows is None:
        return CacheDirective(version, None, keep_from)
    require(isinstance(rows, list) and len(rows) == 2 and all(isinstance(r, int) for r in rows)
            and 0 <= rows[0] < rows[1], ErrorCode.BAD_REQUEST, f"cache rows must be [start, end], got {rows!r}")
    require(rows[1] - rows[0] == length, ErrorCode.BAD_REQUEST,
            f"cache rows {rows[0]}:{rows[1]} do not match the {length} positions sent")
    return CacheDirective(version, (rows[0], rows[1]), keep_from)
