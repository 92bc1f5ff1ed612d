"""Issue 47: a state's scores are bitwise the same whatever else shares its call (swarm/models/invariance.py).

At LLaDA-8B's widths (hidden 4096, 32 heads, SwiGLU 12288), where stock CPU kernels pick another reduction for
another row count: the plain calls fail these tests in bfloat16 and float32 (checked with invariance off)."""
from __future__ import annotations

import pytest
import torch

from swarm.models import invariance
from swarm.models.config import ModelConfig
from swarm.models.modules import BlockSpan, OutputHead, default_positions
from tests.conftest import stop_all

WIDE = ModelConfig(vocab_size=16384, hidden_size=4096, intermediate_size=12288, num_layers=1, num_heads=32,
                   num_kv_heads=32, mask_token_id=1, pad_token_id=0, rope_theta=500000.0)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LENGTHS = (5, 12, 7, 16, 3, 9, 14, 11)  # the states sharing a call: their lengths differ


@pytest.fixture(scope="module")
def wide_parts():
    """One block and a head of 8B widths (a smaller vocabulary: the head's product is the same kind), float32."""
    generator = torch.Generator().manual_seed(0)
    with torch.device("meta"):  # no default init: it drew 284M numbers that were then drawn again
        span, head = BlockSpan(WIDE, 0, 1), OutputHead(WIDE)
    with torch.no_grad():
        for module in (span, head):
            module.to_empty(device="cpu")
            for name, param in module.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.normal_(0, 0.02, generator=generator)
    return span, head


def batched(states: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """States right-padded to the longest, with the key-padding mask (True for real positions)."""
    length = max(s.shape[0] for s in states)
    hidden = torch.zeros(len(states), length, states[0].shape[1], dtype=states[0].dtype)
    mask = torch.zeros(len(states), length, dtype=torch.bool)
    for i, state in enumerate(states):
        hidden[i, :state.shape[0]] = state
        mask[i, :state.shape[0]] = True
    return hidden, mask


def scores(span, head, hidden, mask):
    positions = default_positions(hidden.shape[0], hidden.shape[1], hidden.device)
    return head(span(hidden, mask, positions))


# Batch sizes per dtype: bfloat16 (the served dtype) all 8 states, float32 the first 3 in one batch (its passes cost
# 3-4 times bfloat16's here: 5 passes instead of the 8 of batches of 2 and 5, each state still beside others, at
# another row count than alone and than twice)
BATCH_SIZES = {torch.bfloat16: (2, 5, 8), torch.float32: (3,)}


@pytest.mark.wide
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_one_state_equals_its_row_in_any_batch(wide_parts, dtype):
    """A state alone, then in batches of 2, 5 and 8 states of other lengths (in bfloat16 each state at two places at
    least, beside shorter and longer ones; float32 batches 3): the same logits, bit for bit. (Batch sizes 1-8 each
    were tested once; three sizes keep the 8B-width passes affordable in every run. float16, whose CPU products are
    emulated and took 30 s here, is held to the premise below, product by product.)"""
    span, head = (part.to(dtype) for part in wide_parts)
    sizes = BATCH_SIZES[dtype]
    generator = torch.Generator().manual_seed(1)
    states = [torch.randn(n, WIDE.hidden_size, generator=generator).to(dtype) for n in LENGTHS[:max(sizes)]]
    with torch.no_grad():
        alone = [scores(span, head, *batched([s]))[0] for s in states]
        for size in sizes:  # 8: every state at some place among all others; 5 and 2: other neighbours, places
            picked = states[:size] if size % 2 else states[-size:]
            hidden, mask = batched(picked)
            out = scores(span, head, hidden, mask)
            for row, state in enumerate(picked):
                expected = alone[LENGTHS.index(state.shape[0])]
                assert torch.equal(out[row, :state.shape[0]], expected), (dtype, size, row)
        # the same state unpadded twice in one call (a Picard window's states of one sequence)
        twice = scores(span, head, torch.stack([states[1], states[1]]), None)
        assert torch.equal(twice[1], alone[1]) and torch.equal(twice[0], alone[1])


@pytest.mark.wide
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_state_gets_the_same_rows_in_any_product(wide_parts, dtype):
    """The construction's premise, tested instead of believed, for each weight shape of a block and the head: a
    state's rows are bitwise the same alone (padded to 16 rows, or one product of its own) as inside products of
    every kind :func:`invariance.linear` makes: short, inside the range, and past 512 rows, split across two products
    (not in float16, whose CPU products of 530 rows take minutes at these widths). A server checks its own weights
    at start (``invariance.check_module``)."""
    cases = [(5, 24, 0), (5, 100, 60), (40, 100, 30)]  # (state rows, product rows, the state's first row)
    if dtype != torch.float16:
        cases.append((40, 530, 490))  # rows 490-511 in a 512-row product, 512-529 in an 18-row one
    generator = torch.Generator().manual_seed(2)
    # one weight of each shape (12288x4096, 4096x12288, 4096x4096, the head's 16384x4096): the block's and head's
    # own, in this dtype (a draw of their own drew 67M numbers per dtype)
    span, head = wide_parts
    block = span.blocks["0"]
    weights = (block.mlp.up_proj.weight, block.mlp.down_proj.weight, block.attn.q_proj.weight, head.lm_head.weight)
    with torch.no_grad():
        for weight in (w.to(dtype) for w in weights):
            out_features, in_features = weight.shape
            rows = torch.randn(530, in_features, generator=generator).to(dtype)
            for length, total, place in cases:
                state, others = rows[:length], rows[length:total]
                alone = invariance.linear(state, weight)
                out = invariance.linear(torch.cat([others[:place], state, others[place:]]), weight)
                assert torch.equal(out[place:place + length], alone), (dtype, out_features, length, total, place)


@pytest.mark.unit
def test_training_keeps_the_plain_calls():
    """With autograd on, the products are the plain ones (training needs no invariance and pays nothing)."""
    weight = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(3, 4)
    out = invariance.linear(x, weight)
    assert torch.equal(out, torch.nn.functional.linear(x, weight))
    out.sum().backward()
    assert weight.grad is not None


@pytest.fixture(scope="module")
def wide_model(wide_checkpoint):
    """The checkpoint's model in bfloat16 (2.5 GB at these widths, the 126464-row embedding and head included)."""
    import swarm

    return swarm.DiffusionLM.from_pretrained(str(wide_checkpoint), dtype="bfloat16")


@pytest.fixture(scope="module")
def sequential_tokens(wide_model):
    """``wide_model``'s tokens for a prompt and settings, each run once for the module: the batching modes' draws
    and the swarm test share their sequential references (8 passes of 8B widths each)."""
    runs: dict[tuple, list[int]] = {}

    def tokens(prompt: str, **settings) -> list[int]:
        key = (prompt, tuple(sorted(settings.items())))
        if key not in runs:
            runs[key] = wide_model.generate(prompt, **settings).token_ids
        return runs[key]

    return tokens


@pytest.mark.wide
@pytest.mark.timeout(900)  # 8B-width passes: under a load of 13 on 2 cores the bfloat16 draws took over 300 s
def test_batching_modes_give_the_sequential_tokens_at_8b_widths(wide_model, sequential_tokens):
    """Every kind of mode documented exact gives the sequential run's tokens in bfloat16: a Picard window
    (``parallel_window``), drafts (``draft_steps``), cache fills at every call with guidance (``cache="dual"``,
    ``cache_refresh=1``: the conditional and unconditional rows share each fill pass) and stale steps checked exactly
    (``staleness``, ``stale_check="exact"``). One draw each, named: the hypothesis draw this replaced was derandomized
    to one example, the same every run (a Picard window of 2), so the stale steps never ran here. Without invariance
    the issue's draw once failed (draft_steps=2 changed 6 of 8 tokens); at the suite's one torch thread it no longer
    does (2026-12-06: there a row differs only between a one-row product and a longer one, by last bits that flip no
    greedy token here), so this test holds the modes' exactness, and the tests above hold the invariance it rests on.
    The prefix cache runs at the default model's widths (test_latency_hiding), as does float32 (test_draft_verify):
    here float32's 5.8 GB model cost minutes per draw and, beside another file's 8B-width swarm, a worker's memory.
    The draws run at ``scale="local"``: a caller's modes run the same at every scale, and this process skips the
    start-up check of the 126464-row head (7 CPU s; ``scale="auto"`` asks it only to report it), which the server of
    the swarm test below runs on the same weights and that test requires to hold."""
    # the issue's draw (8 tokens) in 4 steps, 2 tokens each: one reference for drafts, a window and stale steps,
    # and the swarm test's at default settings; each mode's path is the same as in 8 steps at half the 8B-width passes
    issue = dict(prompt="w1 w2 w3 w4", length=8, steps=4, seed=0, cfg=0.0)
    draws = [dict(issue, mode={"draft_steps": 2}), dict(issue, mode={"parallel_window": 2}),
             dict(issue, mode={"staleness": 2, "stale_check": "exact"}),
             dict(prompt="the cat", length=4, steps=4, seed=7, cfg=1.5, mode={"cache": "dual", "cache_refresh": 1})]
    for draw in draws:
        common = dict(gen_length=draw["length"], steps=draw["steps"], block_length=draw["length"], seed=draw["seed"],
                      cfg_scale=draw["cfg"])
        got = wide_model.generate(draw["prompt"], **common, **draw["mode"], scale="local").token_ids
        assert got == sequential_tokens(draw["prompt"], **common), draw


WIDE_PREFIX = "invariance-8b"


@pytest.fixture(scope="module")
def wide_servers(local_swarm, wide_checkpoint):
    """One server of the whole 8B-width checkpoint on the shared swarm (``--blocks 0:1 --head``: 1.5 GB of bfloat16
    weights) for every swarm test at these widths. One: what these tests hold (the swarm's tokens, the client's
    memory with a ``--head`` server) needs no second hop, and a second server cost its start and its own start-up
    check of the block's products (6.4 CPU s); routes over several servers are tested at the default model's widths
    (tests/test_swarm.py)."""
    from swarm.benchmark.realscale import start_span_servers

    servers = start_span_servers(local_swarm, wide_checkpoint, 1, "--compute-threads", "1", "--dht-prefix",
                                 WIDE_PREFIX)
    yield local_swarm
    stop_all(local_swarm, servers)  # a prefix no other test reads


# Timeouts for a loaded 2-core machine, as realscale's: the server's compute challenge (up to 192 rows through
# 8B-width blocks on one thread) outlasted the default 5 s there (load 35-44), and the client then had no route
LOADED_MACHINE_TIMEOUTS = {"connect_timeout": 60, "request_timeout": 120}


@pytest.mark.swarm
def test_swarm_at_default_settings_gives_the_local_tokens(wide_servers, wide_checkpoint, wide_model,
                                                          sequential_tokens):
    """The client at default settings (``scale="auto"``: draft-and-verify through a swarm, as the server announces
    its start-up check of the 8B-width products held): the local sequential run's tokens. With the servers'
    activation caches (fills and reuses, ``cache_refresh=2``: approximate), the local run's tokens at the same
    settings."""
    from swarm.client import DistributedDiffusionLM

    settings = dict(gen_length=8, steps=4, block_length=8, seed=0, cfg_scale=0.0)  # cfg_scale: the default's
    cached = dict(settings, block_length=4, cache="dual", cache_refresh=2)  # two blocks: a fill, then a reuse, each
    expected = sequential_tokens("w1 w2 w3 w4", **settings)  # the batching modes' reference, when they ran
    expected_cached = wide_model.generate("w1 w2 w3 w4", **cached).token_ids
    with DistributedDiffusionLM.from_pretrained(wide_checkpoint, initial_peers=wide_servers.initial_peers,
                                                dht_prefix=WIDE_PREFIX, **LOADED_MACHINE_TIMEOUTS) as lm:
        result = lm.generate("w1 w2 w3 w4", **settings)
        assert result.token_ids == expected, result.info.get("settings")
        # the server's start-up check of its 8B-width block and head held, so the scale batched drafted states
        batching = result.info["settings"]["batching"]
        assert batching["chosen_by"] == "scale" and batching["batch_invariant"] is True, batching
        result = lm.generate("w1 w2 w3 w4", **cached)
        assert result.token_ids == expected_cached, result.info.get("settings")
        assert result.info["cache"]["reuses"] > 0, result.info["cache"]


CLIENT_LIMIT_BYTES = 0.5e9  # issue 54: "the client's memory stays <= 0.5 GB at 8B widths with a --head server"


@pytest.mark.swarm
@pytest.mark.timeout(900)  # 8B-width passes on a loaded 2-core machine
def test_client_stays_under_half_a_gigabyte_in_every_mode_at_8b_widths(wide_servers, wide_checkpoint):
    """Issue 54: a swarm client at 8B widths holds what it needs, not the model it checks. Plain (drafts at
    scale=auto), dual cache and staleness 2 in one client process: its peak resident memory (``VmHWM``: every page
    it held, the checkpoint's mapped pages included) after each mode stays within the bound, the head server answered
    every prediction (the client never read its head), and every drawn check says why it stayed unchecked.

    The client's checkpoint holds every block, so spot checks could recompute any hop; at these widths a block is
    416 MiB and the head 988 MiB, over ``ClientConfig.spot_check_memory_mb``, so they leave the hops unchecked and say
    why. Every hop is drawn for a check (fraction 1.0, the default draws 5%): before the bound (45fbe01) the client
    recomputed them, loaded a block and the head, and this test failed at 2.41 GB after plain. Resident size, not
    malloc's held bytes (tests/test_security_server.py measures those): what grew here were mapped pages. The client
    runs in a process of its own (``swarm.benchmark.client_memory``), so this process's models do not count."""
    from swarm.benchmark.client_memory import MODES, client_run

    # one block of 4 in two steps: every mode's path (a fill and a reuse, a stale step, a draft) and hops drawn for
    # checks in each, with a quarter of the 8B-width passes of 8 steps
    generation = dict(gen_length=4, steps=2, block_length=4, seed=0, temperature=0.0)
    overrides = {"spot_check_fraction": 1.0, **LOADED_MACHINE_TIMEOUTS}
    runs = client_run(str(wide_checkpoint), wide_servers.initial_peers, WIDE_PREFIX, list(MODES), overrides,
                      generation)
    for run in runs:
        assert run.peak_bytes <= CLIENT_LIMIT_BYTES, f"the client peaked at {run.peak_bytes / 1e9:.2f} GB by {run.mode}"
        assert not run.head_loaded
        assert run.spot_checks > 0 and run.unchecked == run.spot_checks, run
        assert all("spot_check_memory_mb" in note for note in run.notes) and run.notes, run.notes
