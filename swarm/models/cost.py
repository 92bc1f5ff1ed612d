"""What a pass costs a server, in units both sides count the same way: the compute queue orders and bounds requests by
it (swarm/server/backend.py), and a client prices its proof of work by it (swarm/wire/work.py)."""
from __future__ import annotations

import math

from swarm.models.config import ModelConfig


def attention_length_scale(config: ModelConfig) -> float:
    """The sequence length at which a block's attention costs as much per token as all its projections.

    Per token a block multiplies by its projections (q, k, v, o and the three MLP matrices), and attention
    adds about 2 x heads x head_dim multiply-adds per position attended: 1,024 positions for the default model,
    about 27,000 at LLaDA-8B's widths, 144 for the test models."""
    d, heads, kv_heads, head_dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    projections = d * heads * head_dim * 2 + 2 * d * kv_heads * head_dim + 3 * d * config.intermediate_size
    return projections / (2 * heads * head_dim)


def request_cost(batch: int, length: int, scale: float) -> int:
    """What a pass of ``batch`` x ``length`` positions is counted at: its tokens, each weighted by
    ``1 + length / scale`` for attention's quadratic term (``scale``: :func:`attention_length_scale`)."""
    return math.ceil(batch * length * (1 + length / scale))
