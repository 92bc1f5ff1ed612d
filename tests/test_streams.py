"""The stream scheduler (swarm/improve/streams.py): pools follow weights, stalled streams give their nodes back, a
stream cannot claim nodes it does not use."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.improve.streams import ClaimError, Stream, assign, check_claim, pool_sizes, report

pytestmark = pytest.mark.unit
# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_pools_follow_the_weights_by_largest_remainder():
    streams = [Stream("tagged", 3.0), Stream("bracketed", 1.0)]
    assert pool_sizes(streams, 8) == {"tagged": 6, "bracketed": 2}
    assert pool_sizes(streams, 5) == {"tagged": 4, "bracketed": 1}  # 3.75 and 1.25: the larger remainder wins
    assert pool_sizes([Stream("a", 1), Stream("b", 1), Stream("c", 1)], 10) == {"a": 4, "b": 3, "c": 3}


def test_a_trivial_stream_gets_one_node_and_a_heavier_weight_a_larger_pool():
    streams = [Stream("hard", 100.0), Stream("trivial", 0.01)]
    assert pool_sizes(streams, 6) == {"hard": 5, "trivial": 1}
    assert pool_sizes(streams, 1) == {"hard": 1, "trivial": 0}, "fewer nodes than streams: the heaviest first"
    light, heavy = pool_sizes([Stream("x", 1), Stream("y", 2)], 9), pool_sizes([Stream("x", 3), Stream("y", 2)], 9)
    assert heavy["x"] > light["x"]


def test_a_stalled_stream_gives_its_nodes_back():
    rising = Stream("rising", 1.0, (0.1, 0.3, 0.5, 0.6))
    stalled = Stream("stalled", 1.0, (0.2, 0.5, 0.5, 0.4, 0.5))
    assert stalled.stalled(patience=3) and not rising.stalled(patience=3)
    assert not Stream("young", 1.0, (0.0, 0.0)).stalled(patience=3), "too young to have stalled"
    assert pool_sizes([rising, stalled], 6, patience=3) == {"rising": 6, "stalled": 0}
    before = assign([rising, Stream("stalled", 1.0, stalled.curve[:2])], [f"n{i}" for i in range(6)])
    after = assign([rising, stalled], [f"n{i}" for i in range(6)], previous=before, patience=3)
    assert set(after.values()) == {"rising"} and len(after) == 6


@FUZZ
@given(weights=st.lists(st.floats(0, 1e6, allow_nan=False) | st.just(float("nan")) | st.just(float("inf")),
                        min_size=1, max_size=8),
       nodes=st.integers(0, 200))
def test_pools_share_out_exactly_the_nodes(weights, nodes):
    streams = [Stream(f"s{i}", w) for i, w in enumerate(weights)]
    sizes = pool_sizes(streams, nodes)
    live = [s for s in streams if s.weight > 0 and s.weight != float("inf") and s.weight == s.weight]
    assert all(size >= 0 for size in sizes.values())
    assert sum(sizes.values()) == (nodes if live else 0)
    if nodes >= len(live):
        assert all(sizes[s.name] >= 1 for s in live), "every live stream gets a node"
    assert all(sizes[s.name] == 0 for s in streams if s not in live)


@FUZZ
@given(weights=st.lists(st.floats(0.01, 100), min_size=1, max_size=5), nodes=st.integers(1, 40),
       moved=st.integers(0, 5))
def test_an_assignment_fills_the_pools_and_keeps_nodes_where_it_can(weights, nodes, moved):
    streams = [Stream(f"s{i}", w) for i, w in enumerate(weights)]
    names = [f"node{i:02d}" for i in range(nodes)]
    first = assign(streams, names)
    sizes = pool_sizes(streams, nodes)
    assert {s: list(first.values()).count(s) for s in sizes} == sizes
    changed = [Stream(s.name, s.weight * (1 + moved) if i == 0 else s.weight) for i, s in enumerate(streams)]
    second = assign(changed, names, previous=first)
    new_sizes = pool_sizes(changed, nodes)
    stayed = sum(first[n] == second.get(n) for n in first)
    assert stayed >= nodes - sum(abs(new_sizes[s] - sizes[s]) for s in sizes), "only the surplus moves"


def test_a_stream_that_claims_nodes_it_does_not_use_is_refused():
    assignment = assign([Stream("a", 1), Stream("b", 1)], ["n1", "n2", "n3", "n4"])
    own = sorted(n for n, s in assignment.items() if s == "a")
    other = sorted(n for n, s in assignment.items() if s == "b")
    check_claim("a", own, assignment, worked={n: 5 for n in own})
    with pytest.raises(ClaimError, match="did no work"):
        check_claim("a", own, assignment, worked={own[0]: 5})
    with pytest.raises(ClaimError, match="not in its pool"):
        check_claim("a", own + other[:1], assignment, worked={n: 5 for n in assignment})
    with pytest.raises(ValueError):
        pool_sizes([Stream("a", 1), Stream("a", 2)], 4)


def test_the_report_shows_streams_pools_and_curves():
    streams = [Stream("a", 2, (0.1, 0.4)), Stream("b", 1, (0.0,))]
    shown = report(streams, assign(streams, ["x", "y", "z"]))
    assert shown == [{"stream": "a", "weight": 2, "pool": ["x", "y"], "curve": [0.1, 0.4], "stalled": False},
                     {"stream": "b", "weight": 1, "pool": ["z"], "curve": [0.0], "stalled": False}]
