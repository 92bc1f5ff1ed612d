"""Issue 54: a swarm client at LLaDA-8B's widths holds what it needs, not the model it checks.

The measurement at 8B widths (a client process beside a ``--head`` server of the 8B-width checkpoint, its peak
resident memory in every mode) is ``test_client_stays_under_half_a_gigabyte_in_every_mode_at_8b_widths`` in
tests/test_invariance.py: it shares that file's checkpoint and server (one 2.5 GB checkpoint and one 8B-width server
for the suite).
Here, in process, what took the client over the bound: the route's compute challenge."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.unit
def test_a_challenge_embeds_a_short_random_prompt_then_masks():
    """A route's compute challenge embeds at most ``CHALLENGE_PROMPT_TOKENS`` random tokens, then the mask token, as a
    generation's first call does: each random token reads its own row of the client's mapped embedding, and 192 of
    them mapped 315 MB of an 8B-width checkpoint into the client (most of what took it over 0.5 GB)."""
    from swarm.client.config import ClientConfig
    from swarm.client.planner import CHALLENGE_PROMPT_TOKENS, CHALLENGE_ROWS, RoutePlanner

    mask, asked = 1000, []
    planner = RoutePlanner(None, None, None, "p", 4, 8, ClientConfig(), vocab_size=1000, mask_token_id=mask)

    def embed(ids):
        asked.append(ids[0].tolist())
        return torch.zeros(*ids.shape, 8)

    planner.embed = embed
    lengths = set()
    for _ in range(64):
        request = planner.challenge_request(0, 4)
        ids = asked[-1]
        prompt = ids.index(mask) if mask in ids else len(ids)
        assert 1 <= prompt <= CHALLENGE_PROMPT_TOKENS and set(ids[prompt:]) <= {mask}, ids
        assert CHALLENGE_ROWS[0] <= len(ids) <= CHALLENGE_ROWS[1] and tuple(request.hidden.shape) == (1, len(ids), 8)
        lengths.add(len(ids))
    assert len(lengths) > 1, "a challenge's length is drawn, as real requests' are"
