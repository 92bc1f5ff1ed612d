"""Whether batch invariance holds where a pass runs, and what the scale does with the answer (issue 47 item 1's
last sentence, issue 54): ``swarm.models.invariance.check_module`` checks the property the untiled products rest on
(a row's numbers do not depend on the product's row count in the checked range, its place or its neighbours) with
the module's own weights on its device; ``scale="auto"`` batches states only where it holds, and
``info["settings"]["batching"]`` says what was chosen and why."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swarm.dht.schema import ServerRecord, ServerState
from swarm.frontend.scale import plan_scale
from swarm.models import invariance
from swarm.models.invariance import DeviceInvariance, check_module, row_count_failure
from swarm.models.modules import BlockSpan, OutputHead
from swarm.testing.checkpoints import tiny_config

pytestmark = pytest.mark.unit
CONFIG = tiny_config()


def tiny_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.ModuleList([BlockSpan(CONFIG, 0, CONFIG.num_layers), OutputHead(CONFIG)]).to(dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_the_cpu_kernels_hold_the_row_count_property_in_every_dtype(dtype):
    found = check_module(tiny_model(dtype))
    assert found.exact, found.why
    assert "16-512 rows at a time" in found.why and str(dtype).replace("torch.", "") in found.why


def count_dependent(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A kernel that takes another path for products of 65-128 rows (as one that splits K by shape could)."""
    return F.linear(x, weight) * (1 + 1e-3 * (64 < x.shape[0] <= 128))


def place_dependent(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A kernel whose rows pick up their place in the product (as an edge-handling path could), the same for every
    row count."""
    return F.linear(x, weight) + (torch.arange(x.shape[0], dtype=x.dtype)[:, None] % 16 == 3) * 1e-3


def neighbour_dependent(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A kernel whose rows depend on their neighbours' values (a reduction across rows), not on their places."""
    return F.linear(x, weight) + x.abs().max() * 1e-3  # the same whatever the order: only padding shows it


@pytest.mark.parametrize("kernel, said", [(count_dependent, "in a product of 127 rows than in one of 512"),
                                          (place_dependent, "at another place among the same rows"),
                                          (neighbour_dependent, "beside padding")])
def test_a_kernel_that_breaks_the_property_is_found_and_named(kernel, said):
    weight = torch.randn(24, 32)
    assert row_count_failure(weight, F.linear) is None
    assert said in row_count_failure(weight, kernel)
    found = check_module(tiny_model(torch.float32), product=kernel)
    assert not found.exact and said in found.why and "float32" in found.why


def test_invariance_turned_off_is_said():
    with invariance.batch_invariance(invariance.BatchInvariance(enabled=False)):
        found = check_module(tiny_model(torch.float32))
    assert not found.exact and "SWARM_BATCH_INVARIANT=0" in found.why


HOLDS = DeviceInvariance(True, "checked")
VARIES = DeviceInvariance(False, "server abcd1234 announces passes that are not batch-invariant")


def test_scale_auto_batches_states_only_where_the_passes_are_invariant():
    asked = []
    assert plan_scale("auto", {}, remote=True, invariance=lambda: asked.append(1) or HOLDS).settings == {
        "draft_steps": 3}
    plan = plan_scale("auto", {}, remote=True, invariance=lambda: VARIES)
    assert plan.settings == {} and plan.invariance == VARIES
    info = plan.batching_info(states_per_call=1)
    assert info["states_per_call"] == 1 and info["chosen_by"] == "none" and info["batch_invariant"] is False
    assert info["why"] == f"scale=auto batches no states here: {VARIES.why}"
    # windows too (random remasking), and max as auto
    assert plan_scale("max", {"remasking": "random"}, remote=True, invariance=lambda: VARIES).settings == {}
    # the caller's own choice is kept, and its info says the identity does not hold here
    mine = plan_scale("auto", {"draft_steps": 2}, remote=True, invariance=lambda: VARIES)
    info = mine.batching_info(states_per_call=3)
    assert mine.settings == {} and info == {"states_per_call": 3, "chosen_by": "caller", "batch_invariant": False,
                                            "why": VARIES.why}
    # nothing to batch (local, staleness, correctors): the check is not even asked for
    for settings, remote, correctors in (({}, False, 0), ({"staleness": 2}, True, 0), ({}, True, 1)):
        assert plan_scale("auto", settings, remote=remote, correctors=correctors,
                          invariance=lambda: pytest.fail("asked")).invariance is None
    assert asked == [1]


def test_a_record_says_invariant_only_when_it_says_so_exactly():
    value = ServerRecord("peer", ServerState.ONLINE, 0, 4, 10.0, batch_invariant=True).to_value()
    assert ServerRecord.from_value("peer", value).batch_invariant is True
    for claim in (None, 1, "true", [True]):
        assert ServerRecord.from_value("peer", {**value, "batch_invariant": claim}).batch_invariant is False
    del value["batch_invariant"]
    assert ServerRecord.from_value("peer", value).batch_invariant is False, "an older server's record"
