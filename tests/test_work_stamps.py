"""Work stamps (issue 55 class 6; swarm/wire/work.py, swarm/server/work_check.py): what a caller proves for a busy
server's fair order. Minted for one server and one caller, checked in one hash, credited once, never banked past its
epoch, the check's memory bounded; the request directive fuzzed; a client stamps where the server is contended.
Unit tests: no socket, no process; the live path (a client's stamps credited by a real server) is in
tests/test_usage_swarm.py."""
from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.server.work_check import StampCheck
from swarm.wire.messages import RemoteError
from swarm.wire.work import (
    EPOCH_S,
    MAX_FLOOR_BITS,
    MIN_BITS,
    NO_FLOOR,
    WORK_PRICE,
    Stamper,
    WorkStamp,
    announced_floor,
    bits_for,
    mint,
    parse_work,
)

SERVER, CALLER, NOW = "server-id", "caller-id", 1_000_000 * EPOCH_S
SALT = "0123456789abcdef"


def test_a_stamp_proves_its_bits_only_for_its_server_and_caller():
    stamp = mint(SERVER, CALLER, 14, NOW, SALT)
    assert stamp.bits(SERVER, CALLER) >= 14
    assert stamp.bits("other-server", CALLER) < MIN_BITS and stamp.bits(SERVER, "other-caller") < MIN_BITS
    assert parse_work(stamp.to_dict()) == stamp


def test_the_price_asks_for_a_calls_cost_in_hashes():
    assert bits_for(1, WORK_PRICE) == MIN_BITS  # the least a stamp is credited for
    assert bits_for(13600, WORK_PRICE) == 18  # 200 x 64 positions: about 260,000 hashes
    assert 2**bits_for(150, WORK_PRICE) >= 150 * WORK_PRICE


def test_a_stamp_is_credited_once_in_its_epoch_and_never_after():
    check = StampCheck()
    stamp = mint(SERVER, CALLER, 12, NOW, SALT)
    credit = check.credit(stamp, SERVER, CALLER, NOW)
    assert credit >= 2**12 / WORK_PRICE
    assert check.credit(stamp, SERVER, CALLER, NOW) == 0.0  # spent
    assert check.credit(stamp, SERVER, "thief", NOW) == 0.0  # names another caller: worth nothing to the thief
    assert check.credit(mint(SERVER, CALLER, 12, NOW - 2 * EPOCH_S, SALT), SERVER, CALLER, NOW) == 0.0  # banked
    assert check.credit(mint(SERVER, CALLER, 12, NOW + 2 * EPOCH_S, SALT), SERVER, CALLER, NOW) == 0.0  # ahead
    assert check.credit(mint(SERVER, CALLER, 12, NOW - EPOCH_S, SALT), SERVER, CALLER, NOW) > 0  # clock skew
    short = next(WorkStamp(int(NOW // EPOCH_S), SALT, counter) for counter in range(10**6)
                 if WorkStamp(int(NOW // EPOCH_S), SALT, counter).bits(SERVER, CALLER) < MIN_BITS)
    assert check.credit(short, SERVER, CALLER, NOW) == 0.0
    assert check.credit(None, SERVER, CALLER, NOW) == 0.0
    assert check.info()["refused"] == {"spent": 1, "stale": 2, "short": 2}  # the thief's proves nothing


def stamps_of(bits: int, count: int, caller: str = "attacker", now: float = NOW) -> list[WorkStamp]:
    """``count`` stamps proving exactly ``bits`` (about half of those minted at ``bits``), each under its own salt."""
    found: list[WorkStamp] = []
    for index in range(10**6):
        stamp = mint(SERVER, caller, bits, now, f"{index:016x}")
        if stamp.bits(SERVER, caller) == bits:
            found.append(stamp)
        if len(found) == count:
            return found
    raise AssertionError("unreachable")


def test_a_flood_of_cheap_stamps_raises_the_floor_and_never_shuts_out_a_stamp_above_it():
    """Issue 55 class 1 at the work check: a table full of one attacker's cheapest stamps used to refuse every
    stamp ("full"), keeping every honest caller in the newcomers' turn. Now a stamp worth more takes the cheapest
    one's place, and a forgotten stamp re-sent is refused: the floor rose to its bits."""
    check = StampCheck(max_spent=8)
    flood = stamps_of(MIN_BITS, 12)
    credited = [check.credit(stamp, SERVER, "attacker", NOW) for stamp in flood]
    assert all(credited[:8]) and not any(credited[8:])  # full of MIN_BITS: another one is worth no more
    assert check.info()["refused"] == {"below floor": 4} and check.floor(NOW) == MIN_BITS
    assert check.announced(NOW) == MIN_BITS
    honest = mint(SERVER, CALLER, MIN_BITS + 4, NOW, SALT)
    assert check.credit(honest, SERVER, CALLER, NOW) >= 2**(MIN_BITS + 4) / WORK_PRICE
    assert check.info()["forgotten"] == 1 and check.info()["remembered"] == 8
    assert check.credit(flood[0], SERVER, "attacker", NOW) == 0.0  # the stamp forgotten: at the floor, refused
    assert check.credit(honest, SERVER, CALLER, NOW) == 0.0  # still remembered: spent
    assert all(check.credit(stamp, SERVER, "attacker", NOW) == 0.0 for stamp in flood)  # none credited twice
    assert check.info()["refused"] == {"below floor": 4 + 1 + 12 - 7, "spent": 1 + 7}


def test_the_floor_ages_out_with_the_epoch_of_the_stamps_it_forgot():
    check = StampCheck(max_spent=2)
    for stamp in stamps_of(MIN_BITS, 2):
        check.credit(stamp, SERVER, "attacker", NOW)
    assert check.credit(mint(SERVER, CALLER, MIN_BITS + 3, NOW, SALT), SERVER, CALLER, NOW) > 0
    assert check.floor(NOW) == MIN_BITS and check.floor(NOW + EPOCH_S) == MIN_BITS  # the epoch still counts
    later = NOW + 2 * EPOCH_S  # the forgotten stamp's epoch is two behind: it is stale anyway, and so is the floor
    assert check.floor(later) == NO_FLOOR and check.announced(later) is None
    fresh = stamps_of(MIN_BITS, 1, CALLER, later)[0]
    assert check.credit(fresh, SERVER, CALLER, later) > 0 and check.info()["remembered"] == 1


def test_each_stamp_costs_the_check_the_same_few_steps_however_full_its_table():
    """O(1) per stamp, counted in lines the check runs (not in time): no step scans the remembered stamps, and an
    epoch is forgotten whole. A table of 96 stamps costs each call no more lines than a table of 4."""
    import sys

    from swarm.server import work_check

    pool = stamps_of(MIN_BITS, 96) + [mint(SERVER, "attacker", MIN_BITS + 1 + index % 4, NOW, f"{index:016x}")
                                      for index in range(200, 232)]
    ahead = stamps_of(MIN_BITS, 8, now=NOW + EPOCH_S)

    def most_lines_per_call(max_spent: int) -> int:
        check, lines = StampCheck(max_spent=max_spent), [0]

        def trace(frame, event, arg):
            if frame.f_code.co_filename == work_check.__file__:
                if event == "line":
                    lines[0] += 1
                return trace
            return None

        most = 0
        for stamp, now in [(stamp, NOW) for stamp in pool] + [(stamp, NOW + 2 * EPOCH_S) for stamp in ahead]:
            lines[0] = 0
            sys.settrace(trace)
            try:
                check.credit(stamp, SERVER, "attacker", now)
            finally:
                sys.settrace(None)
            most = max(most, lines[0])
        assert check.info()["forgotten"] > 0  # the big table was full too: its calls forgot stamps
        return most

    small, big = most_lines_per_call(4), most_lines_per_call(96)
    assert big <= small + 4 and big < 96, (small, big)  # a scan of the table would take 96 lines or more


def test_a_client_mints_above_the_floor_a_server_announces_up_to_its_cap():
    import asyncio

    import torch

    from swarm.server.request_reader import Received
    from swarm.server.span_calls import answer_note
    from swarm.wire.messages import ForwardRequest

    stamper = Stamper(CALLER, WORK_PRICE, lambda batch, length: batch * length)
    request = ForwardRequest(0, 1, torch.zeros(1, 4, 8))
    received = Received(None, request.hidden, None, held=False, cost=4)
    note = answer_note(received, None, floor=MIN_BITS + 2)
    assert note == {"floor": MIN_BITS + 2} and answer_note(received, None) == {}
    stamper.note(SERVER, contended=True, floor=announced_floor(note))
    assert stamper.bits(SERVER, request) == MIN_BITS + 3
    now = time.time()
    check = StampCheck(max_spent=1)  # a server whose table holds one stamp of MIN_BITS + 2: its floor
    assert check.credit(stamps_of(MIN_BITS + 2, 1, now=now)[0], SERVER, "attacker", now) > 0
    assert check.floor(now) == MIN_BITS + 2
    assert check.credit(asyncio.run(stamper.stamp(SERVER, request)).work, SERVER, CALLER, now) > 0  # above it
    stamper.note(SERVER, contended=True, floor=MAX_FLOOR_BITS)  # past what this client pays: no stamp at all
    assert stamper.bits(SERVER, request) is None and asyncio.run(stamper.stamp(SERVER, request)).work is None
    stamper.note(SERVER, contended=True)  # the floor fell back: the call's own cost again
    assert stamper.bits(SERVER, request) == bits_for(4, WORK_PRICE)
    for malformed in (True, "12", -3, 2**300, 12.0, None, [12]):
        assert announced_floor({"floor": malformed}) == NO_FLOOR


def test_bad_work_directives_are_refused_clearly():
    for value in (None, [], {"epoch": 1, "salt": SALT}, {"epoch": -1, "salt": SALT, "counter": 0},
                  {"epoch": 1, "salt": "XYZ", "counter": 0}, {"epoch": True, "salt": SALT, "counter": 0},
                  {"epoch": 1, "salt": SALT, "counter": 2**64}, {"epoch": 1, "salt": SALT, "counter": 0, "x": 1}):
        with pytest.raises(RemoteError, match="'work'"):
            parse_work(value)


# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | st.binary(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.sampled_from(["epoch", "salt", "counter", "x"]), inner, max_size=4), max_leaves=12))
def test_the_work_directive_parser_takes_anything_and_answers_a_stamp_or_a_clear_error(value):
    try:
        stamp = parse_work(value)
    except RemoteError:
        return
    assert StampCheck().credit(stamp, SERVER, CALLER, NOW) >= 0.0


def test_a_client_stamps_its_first_call_and_then_only_while_the_server_says_it_is_contended():
    """Stamps matter only under contention: a client mints nothing for a server it has to itself after its first
    call, and stamps every call for ``busy_s`` after an answer that said its request had waited for another's."""
    import asyncio

    import torch

    from swarm.wire.messages import ForwardRequest

    stamper = Stamper(CALLER, WORK_PRICE, lambda batch, length: batch * length, busy_s=60.0)
    request = ForwardRequest(0, 1, torch.zeros(1, 4, 8))

    def stamped() -> bool:
        return asyncio.run(stamper.stamp(SERVER, request)).work is not None

    assert stamped()  # the first call: a turn of its own even during a flood
    stamper.note(SERVER, contended=False, now=NOW)
    assert not stamper.wanted(SERVER, NOW + 1) and not stamped()
    stamper.note(SERVER, contended=True, now=NOW)
    assert stamper.wanted(SERVER, NOW + 59) and not stamper.wanted(SERVER, NOW + 61)
    stamper.note(SERVER, contended=False, now=NOW + 30)  # an uncontended answer does not cut the busy time short
    assert stamper.wanted(SERVER, NOW + 59)
    work = asyncio.run(stamper.stamp("fresh-server", request)).work
    assert work.bits("fresh-server", CALLER) >= bits_for(4, WORK_PRICE) and stamper.minted == 2


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        StampCheck(price=0)
    with pytest.raises(ValueError):
        mint(SERVER, CALLER, 64)


# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(["floor", "contended", "x"]), st.none() | st.booleans() | st.integers() |
                       st.floats() | st.text(max_size=8) | st.lists(st.integers(), max_size=2), max_size=3))
def test_an_announced_floor_is_read_from_any_metadata_as_bits_or_none(metadata):
    floor = announced_floor(metadata)
    assert type(floor) is int and NO_FLOOR <= floor <= 256
    assert floor == NO_FLOOR or floor == metadata["floor"]
