"""Work stamps (issue 55 class 6; swarm/wire/work.py, swarm/server/work_check.py): what a caller proves for a busy
server's fair order. Minted for one server and one caller, checked in one hash, credited once, never banked past its
epoch, the check's memory bounded; the request directive fuzzed; a client stamps where the server is contended.
Unit tests: no socket, no process; the live path (a client's stamps credited by a real server) is in
tests/test_usage_swarm.py."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.server.work_check import StampCheck
from swarm.wire.messages import RemoteError
from swarm.wire.work import EPOCH_S, MIN_BITS, WORK_PRICE, Stamper, WorkStamp, bits_for, mint, parse_work

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


def test_a_full_check_refuses_new_stamps_rather_than_forget_spent_ones():
    check = StampCheck(max_spent=2)
    stamps = [mint(SERVER, CALLER, MIN_BITS, NOW, f"{index:016x}") for index in range(3)]
    assert check.credit(stamps[0], SERVER, CALLER, NOW) > 0 and check.credit(stamps[1], SERVER, CALLER, NOW) > 0
    assert check.credit(stamps[2], SERVER, CALLER, NOW) == 0.0  # full: refused, and stamps[0] still remembered
    assert check.credit(stamps[0], SERVER, CALLER, NOW) == 0.0
    later = NOW + 2 * EPOCH_S  # their epoch is two behind: forgotten, and they could not be credited any more anyway
    assert check.credit(mint(SERVER, CALLER, MIN_BITS, later, SALT), SERVER, CALLER, later) > 0
    assert check.credit(stamps[0], SERVER, CALLER, later) == 0.0
    assert check.info()["remembered"] == 1


def test_bad_work_directives_are_refused_clearly():
    for value in (None, [], {"epoch": 1, "salt": SALT}, {"epoch": -1, "salt": SALT, "counter": 0},
                  {"epoch": 1, "salt": "XYZ", "counter": 0}, {"epoch": True, "salt": SALT, "counter": 0},
                  {"epoch": 1, "salt": SALT, "counter": 2**64}, {"epoch": 1, "salt": SALT, "counter": 0, "x": 1}):
        with pytest.raises(RemoteError, match="'work'"):
            parse_work(value)


@settings(max_examples=300, deadline=None)
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
