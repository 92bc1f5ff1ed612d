"""The compute scheduler (issue 48 item 5, swarm/server/scheduler.py): work-conserving, fair by identity, sybil-aware,
bounded. Unit tests: no process, no socket, no clock (it is passed in); the live server is in tests/test_usage_swarm.py.
"""
from collections import Counter

import pytest

from swarm.server.scheduler import NEWCOMERS, FairScheduler, Job
from swarm.server.usage import UsageLedger


def established(scheduler: FairScheduler, *peers: str) -> None:
    """Make ``peers`` long-standing users: served enough passes over more than the age."""
    for peer in peers:
        for index in range(scheduler.establish_requests):
            scheduler.served(peer, now=index * scheduler.establish_age / (scheduler.establish_requests - 1))
        assert scheduler.is_established(peer)


def drain(scheduler: FairScheduler, count: int) -> list[str]:
    order = []
    for _ in range(count):
        job = scheduler.pop()
        if job is None:
            break
        order.append(job.peer)
    return order


def test_the_red_teams_stranger_never_keeps_a_heavy_user_waiting_on_an_idle_server():
    """Issue 48 item 5: with --max-share-per-caller 0.5 a stranger's 1-position call every 20 s made the heavy user
    'over its share' and the old ledger refused it while the server sat idle. Now its share only orders it behind
    callers that wait: with nobody else waiting, its pass is the next to run, every time."""
    ledger = UsageLedger(max_share=0.5, window=60.0)
    scheduler = FairScheduler(establish_age=60.0, over_share=lambda peer: ledger.over_share(peer, now))
    now = 0.0
    for step in range(200):
        now = step * 0.5
        if step % 40 == 0:  # the stranger: one position every 20 s, served at once
            scheduler.push(Job("stranger", 1.0))
            assert scheduler.pop().peer == "stranger"
            ledger.record("stranger", 1, 0.0005, now)
        scheduler.push(Job("heavy", 64.0))
        assert ledger.over_share("heavy", now) or step == 0  # the old cap would have refused this pass
        job = scheduler.pop()  # work-conserving: nothing else waits, so the heavy pass runs now
        assert job is not None and job.peer == "heavy"
        ledger.record("heavy", 64, 0.5, now)
        scheduler.served("heavy", now)
    assert len(scheduler) == 0


def test_over_its_share_a_caller_goes_after_those_within_theirs():
    over = {"heavy"}
    scheduler = FairScheduler(over_share=lambda peer: peer in over)
    established(scheduler, "heavy", "light")
    for _ in range(3):
        scheduler.push(Job("heavy", 1.0))
    scheduler.push(Job("light", 1.0))
    assert drain(scheduler, 4) == ["light", "heavy", "heavy", "heavy"]


def test_under_contention_identities_are_served_in_fair_order_by_cost():
    scheduler = FairScheduler()
    established(scheduler, "a", "b")
    for _ in range(40):
        scheduler.push(Job("a", 4.0))  # a's passes cost four times b's
    for _ in range(80):
        scheduler.push(Job("b", 1.0))
    first = Counter()
    for _ in range(50):
        job = scheduler.pop()
        first[job.peer] += job.cost
    assert abs(first["a"] - first["b"]) <= 4.0  # equal compute, not equal counts of passes
    assert first["b"] > first["a"] / 4  # b got more passes in


def test_a_flow_that_idled_banks_no_credit():
    scheduler = FairScheduler()
    established(scheduler, "a", "b")
    for _ in range(20):
        scheduler.push(Job("a", 1.0))
    drain(scheduler, 20)  # a alone: served, b idle
    for _ in range(10):
        scheduler.push(Job("a", 1.0))
        scheduler.push(Job("b", 1.0))
    order = drain(scheduler, 10)
    assert Counter(order) == {"a": 5, "b": 5}  # b did not get 20 passes of back pay


def test_a_caller_that_sends_its_next_pass_as_soon_as_its_last_is_answered_gets_its_share_not_more():
    """A closed loop (one pass waiting at a time, the usual client) empties its flow after every pass: it must come
    back at its finish tag, or it would be served again for free and take nearly everything."""
    scheduler = FairScheduler()
    established(scheduler, "loop", "backlog")
    for _ in range(100):
        scheduler.push(Job("backlog", 1.0))
    served = Counter()
    scheduler.push(Job("loop", 1.0))
    for _ in range(60):
        job = scheduler.pop()
        served[job.peer] += 1
        if job.peer == "loop":
            scheduler.push(Job("loop", 1.0))  # answered: its next pass
    assert abs(served["loop"] - served["backlog"]) <= 2


@pytest.mark.parametrize("fresh", [10, 1000])
def test_fresh_ids_per_call_get_no_more_than_one_identitys_part(fresh):
    """Issue 48 item 5, the sybil half: a fresh peer id per call. Every id not yet established shares one flow, so
    under contention a thousand of them get together what one long-standing user gets (per-id fairness would give
    them fresh / (fresh + 1) of the compute)."""
    scheduler = FairScheduler()
    established(scheduler, "regular")
    for _ in range(fresh):
        scheduler.push(Job("regular", 1.0))
    for index in range(fresh):
        scheduler.push(Job(f"sybil-{index}", 1.0))
    served = Counter("regular" if peer == "regular" else "sybils" for peer in drain(scheduler, fresh))
    assert served["regular"] >= fresh // 2 and served["sybils"] <= fresh - fresh // 2


def test_newcomers_are_served_round_robin_among_themselves():
    scheduler = FairScheduler()
    for _ in range(3):
        scheduler.push(Job("n1", 1.0))
    scheduler.push(Job("n2", 1.0))
    scheduler.push(Job("n3", 1.0))
    assert drain(scheduler, 5) == ["n1", "n2", "n3", "n1", "n1"]


def test_an_identity_is_established_only_after_enough_passes_and_time():
    scheduler = FairScheduler(establish_requests=4, establish_age=100.0)
    for index in range(50):  # many passes, quickly: still a newcomer
        scheduler.served("eager", now=index * 0.1)
    assert not scheduler.is_established("eager")
    scheduler.served("patient", now=0.0)
    scheduler.served("patient", now=200.0)  # old enough, too few passes
    assert not scheduler.is_established("patient")
    scheduler.served("patient", now=201.0)
    scheduler.served("patient", now=202.0)
    assert scheduler.is_established("patient")
    assert scheduler.flow_key("eager") == NEWCOMERS and scheduler.flow_key("patient") == "patient"


def test_a_newcomer_that_becomes_established_takes_its_queued_passes_along():
    scheduler = FairScheduler(establish_requests=1, establish_age=0.0)
    scheduler.push(Job("n", 1.0))
    scheduler.push(Job("n", 1.0))
    scheduler.served("n", now=0.0)
    assert NEWCOMERS not in scheduler.flows and len(scheduler.flows["n"].jobs) == 2
    assert drain(scheduler, 3) == ["n", "n"]


def test_a_flood_of_fresh_ids_forgets_only_newcomers_and_state_stays_bounded():
    scheduler = FairScheduler(max_identities=64)
    established(scheduler, "regular")
    for index in range(10_000):
        scheduler.served(f"sybil-{index}", now=float(index))
    assert scheduler.is_established("regular")
    assert len(scheduler.newcomers) == 64 and len(scheduler.established) == 1
    assert scheduler.flows == {}  # nothing queued: no flow kept


def test_dropped_passes_are_skipped_and_matching_pops_only_take_what_matches():
    scheduler = FairScheduler()
    gone = Job("a", 1.0, dropped=lambda: True)
    scheduler.push(gone)
    scheduler.push(Job("b", 1.0, key="x"))
    scheduler.push(Job("c", 1.0, key="y"))
    assert scheduler.pop(lambda job: job.key == "y").peer == "c"
    assert scheduler.pop(lambda job: job.key == "y") is None
    assert scheduler.pop().peer == "b" and scheduler.pop() is None and len(scheduler) == 0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        FairScheduler(max_identities=0)
    with pytest.raises(ValueError):
        FairScheduler(establish_age=-1.0)
