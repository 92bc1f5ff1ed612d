"""Issue 54: a swarm client at LLaDA-8B's widths holds what it needs, not the model it checks.

Two servers of a 2-block checkpoint of LLaDA-8B's widths and vocabulary (``--blocks 0:1``, ``--blocks 1:2 --head``);
the client process's peak resident memory (``VmHWM``: every page it held, the checkpoint's mapped pages included)
after generating in each mode. The client's checkpoint holds every block, so spot checks could recompute any hop
here; at these widths a block is 416 MiB and the head 988 MiB, over ``ClientConfig.spot_check_memory_mb``, so they
leave the hops unchecked and say why. Every hop is drawn for a check (fraction 1.0, the default draws 5%): before the
bound (45fbe01) the client recomputed them, loaded a block and the head, and this test failed at 2.41 GB after plain.
Resident size, not malloc's held bytes (tests/test_security_server.py measures those): what grew here were mapped
pages, which malloc never sees; the client holds 0.34 GB, so the MBs the resident size moves between runs do not
matter (it held 0.46 GB, and this test failed once at 0.51 GB, before its embedding skipped a random draw on the meta
device that imported sympy)."""
from __future__ import annotations

import pytest
import torch

from swarm.benchmark.client_memory import MODES, client_run
from swarm.benchmark.realscale import start_span_servers
from swarm.utils.local_swarm import LocalSwarm

LIMIT_BYTES = 0.5e9  # issue 54: "the client's memory stays <= 0.5 GB at 8B widths with a --head server"
PREFIX = "client-memory-8b"


@pytest.fixture(scope="module")
def wide_swarm(wide_checkpoint):
    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        start_span_servers(swarm, wide_checkpoint, 1, "--compute-threads", "1", "--dht-prefix", PREFIX)
        yield swarm


@pytest.mark.timeout(900)  # 8B-width passes on a loaded 2-core machine
def test_client_stays_under_half_a_gigabyte_in_every_mode_at_8b_widths(wide_swarm, wide_checkpoint):
    """Plain (drafts at scale=auto), dual cache and staleness 2 in one client process: its peak after each mode
    (so after the last, the peak of all) stays within the bound, the head servers answered every prediction (the
    client never read its head), and every drawn check says why it stayed unchecked."""
    generation = dict(gen_length=8, steps=8, block_length=4, seed=0, temperature=0.0)
    # Timeouts for a loaded 2-core machine, as realscale's: the head server's challenge (up to 192 rows through an
    # 8B-width block and head on one thread) outlasted the default 5 s there, and the client then had no route
    overrides = {"spot_check_fraction": 1.0, "connect_timeout": 60, "request_timeout": 120}
    runs = client_run(str(wide_checkpoint), wide_swarm.initial_peers, PREFIX, list(MODES), overrides, generation)
    for run in runs:
        assert run.peak_bytes <= LIMIT_BYTES, f"the client peaked at {run.peak_bytes / 1e9:.2f} GB by {run.mode}"
        assert not run.head_loaded
        assert run.spot_checks > 0 and run.unchecked == run.spot_checks, run
        assert all("spot_check_memory_mb" in note for note in run.notes) and run.notes, run.notes


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
