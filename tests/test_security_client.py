"""Attacks on the client through the servers it meets: tarpits and liars (issue 16, items 5 and 6; issue 33,
item 3: a lying head server, a liar acting only as checker, predictable checks, challenges told apart by size).

Each test replays an attack against real server processes on 127.0.0.1 and checks that the client loses
seconds, not minutes, and never returns tokens it could not verify: a disagreement nobody can settle is redone
elsewhere or stops the generation, never settled by trusting one side.
"""
from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from swarm.client import MissingBlocksError
from swarm.client.config import ClientConfig
from swarm.client.peers import PeerHealth
from swarm.client.spot_check import OWN_HIDDEN_STATES, UnverifiedResultError
from swarm.dht.schema import ServerState, default_prefix, read_servers
from swarm.frontend.local import DiffusionLM
from tests.conftest import (
    RARE_ANNOUNCEMENTS,
    SERVER,
    make_checkpoint,
    start_all,
    stop_all,
    swarm_client,
    tiny_config,
    wait_all,
    wait_seen,
    wait_until,
)

TARPIT = (str(Path(__file__).with_name("tarpit_server.py")),)
FAULTY = (str(Path(__file__).with_name("faulty_server.py")),)
SETTINGS = dict(gen_length=16, steps=8, block_length=8, seed=5, temperature=0.5)


# ----- peer health on its own --------------------------------------------------------------------------
def test_bans_outlast_the_timeout_and_timeouts_follow_measured_speed():
    config = ClientConfig(request_timeout=30.0, ban_base=15.0, timeout_floor=2.0, timeout_factor=4.0)
    health = PeerHealth(config)
    assert health.record_failure("a", "timed out", stalled=True) >= 2 * config.request_timeout
    assert not health.usable("a")
    health.forgive("a", "new addresses")
    assert not health.usable("a"), "a peer that stalled a call is never forgiven early"
    assert health.record_failure("c", "could not dial") == config.ban_base
    health.forgive("c", "new addresses")
    assert health.usable("c") and not health.measured("c"), "forgiven, and challenged again before use"
    assert health.timeout("b", 100) == config.request_timeout, "an unmeasured peer gets the full timeout"
    health.record_ping("b", 0.01)
    health.record_success("b", 0.01 + 0.001 * 4, work=4)  # one-token challenge over 4 blocks: 1 ms per unit
    assert health.timeout("b", 100) == pytest.approx(2.0 + 4.0 * (0.01 + 0.1))
    assert health.timeout("b", 10**9) == config.request_timeout, "never more than the request timeout"
    health.distrust("b", "lied")
    assert not health.usable("b") and "b" in health.distrusted


def test_a_call_queued_behind_this_clients_own_calls_gets_their_time_too():
    """Pipelined passes (staleness) and a pushed pass's later hops wait at a server behind this client's earlier
    calls: their time is the client's own doing, so it is added to the timeout, past the request timeout if
    need be, and a live server is never timed out (and avoided) for answering in order."""
    config = ClientConfig(request_timeout=30.0, timeout_floor=2.0, timeout_factor=4.0)
    health = PeerHealth(config)
    health.record_ping("b", 0.01)
    health.record_success("b", 0.01 + 0.001 * 4, work=4)  # 1 ms per unit
    alone = health.timeout("b", 100)
    with health.calling("b", 1000):
        assert health.timeout("b", 100) == pytest.approx(alone + 4.0 * 0.001 * 1000)
        assert health.timeout("c", 100) == config.request_timeout, "another peer's queue is its own"
        with health.calling("b", 10**5):
            assert health.timeout("b", 100) > config.request_timeout
    assert health.timeout("b", 100) == pytest.approx(alone), "an answered call leaves the queue"


@pytest.mark.parametrize("field, value", [("timeout_floor", -1.0), ("timeout_factor", 0.0),
                                          ("request_timeout", float("nan")), ("spot_check_fraction", 1.5)])
def test_client_settings_that_would_break_every_call_are_refused(field, value):
    config = ClientConfig()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        config.validate()


# ----- tarpits -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tarpitted(local_swarm, liar_models, liar_local):
    """The liars' model (below) and its slowest honest server for the tarpit tests, booting while the first test
    starts its fakes, and the tokens the local model gives (the same prompt and settings in each test). Each test's
    fakes join that model and are killed at its end (their records stay, as a crashed tarpit's would); its client
    routes only through the honest server and its own fakes, as on a model of their own."""
    path, servers = liar_models
    return path, servers["honest_slow"], liar_local.generate("tarpit", **SETTINGS)


def test_four_tarpits_cost_one_short_challenge_not_minutes(local_swarm, tarpitted, swarm_peer):
    """Four fakes announce every block at a huge throughput and never answer a forward call; the old client
    gave up after 4 timeouts (121 s). Now each fails its compute challenge, all at once, before any route.

    One of the four answers one-token calls and holds the rest (it hoped the compute challenge is one token, as it
    was): the challenge is shaped like a real pass (its length drawn like real requests'), so it fails too and no
    call of the generation is ever sent to it (with a one-token challenge it is routed first, and the generation
    loses a timeout to it). It is one of the four rather than a fifth fake of a test of its own: a fake is a server
    start, its daemon and DHT process (1.5-2 CPU s), and the same client, route and generation catch both kinds."""
    tarpit_model, honest, expected = tarpitted
    holds_all = ("0:4", ("--throughput", "1e9", *RARE_ANNOUNCEMENTS), TARPIT)
    short_only = ("0:4", ("--throughput", "1e9", "--public-name", "tarpit-large", *RARE_ANNOUNCEMENTS), TARPIT)
    fakes = start_all(local_swarm, tarpit_model, [holds_all] * 3 + [short_only])
    wait_all(local_swarm, [honest])
    try:
        with attack_client(local_swarm, tarpit_model, [honest, *fakes], swarm_peer, request_timeout=30.0,
                           connect_timeout=3.0) as lm:
            started = time.monotonic()
            result = lm.generate("tarpit", **SETTINGS)
            elapsed = time.monotonic() - started
            print(f"generation past four tarpits: {elapsed:.2f} s")
            assert result.token_ids == expected.token_ids
            assert all(fake.peer_id[-8:] not in " ".join(result.info["route"]) for fake in fakes)
            assert {fake.peer_id for fake in fakes} <= lm.sequence.health.excluded(), "each failed its challenge"
            # Caught by the challenge alone: no call of the generation was sent to a fake (no request timeout).
            assert result.info["failovers"] == []
    finally:
        stop_all(local_swarm, fakes)


def test_a_tarpit_that_passes_the_challenge_costs_one_adaptive_timeout(local_swarm, tarpitted, swarm_peer):
    """A smarter fake answers its first call (the challenge, whatever its shape) and holds the rest: the call
    times out after what its measured speed predicts (seconds), not the 30 s request timeout, and it is not asked
    again in that call."""
    tarpit_model, honest, expected = tarpitted
    fake, = start_all(local_swarm, tarpit_model,
                      [("0:4", ("--throughput", "1e9", "--public-name", "faulty-stall", *RARE_ANNOUNCEMENTS), FAULTY)])
    wait_all(local_swarm, [honest])
    try:
        with attack_client(local_swarm, tarpit_model, [honest, fake], swarm_peer, request_timeout=30.0,
                           timeout_floor=2.0) as lm:
            wait_seen(lm, [fake])  # a loaded machine's DHT read can miss it, and the route then goes without it
            assert lm.show_route()[0].peer_id == fake.peer_id, "the fake passes the challenge and looks fastest"
            rows = len(lm.encode_prompt("tarpit")) + SETTINGS["gen_length"]
            waits = lm.sequence.health.timeout(fake.peer_id, rows * lm.config.num_layers)
            started = time.monotonic()
            result = lm.generate("tarpit", **SETTINGS)
            elapsed = time.monotonic() - started
            print(f"generation past one tarpit that passes the challenge: {elapsed:.2f} s (waited at most "
                  f"{waits:.2f} s for it)")
            assert result.token_ids == expected.token_ids
            lost = [event for event in result.info["failovers"] if event["peer_id"] == fake.peer_id]
            assert len(lost) == 1 and "timeout" in lost[0]["error"], "a peer that stalled a call is not asked again"
            # The wait follows the speed the challenge measured, not the request timeout.
            assert waits < lm.client_config.request_timeout / 3, waits
    finally:
        stop_all(local_swarm, [fake])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_server_restarted_elsewhere_with_its_identity_is_reached_at_once(local_swarm, tmp_path, swarm_peer):
    """The client's daemon knows only the old address; the server's signed record carries the new one, so the
    client dials it and lifts its ban instead of waiting for it to expire (before: 15-20 s unreachable)."""
    tarpit_model = make_checkpoint(tmp_path / "moved", tiny_config(), seed=16)  # no other server of it
    identity = str(tmp_path / "server.key")
    settings = dict(gen_length=8, steps=2, block_length=8)
    expected = DiffusionLM.from_pretrained(tarpit_model).generate("moved", **settings)

    def on_a_new_port():
        listen = ("--identity-path", identity, "--host-maddrs", f"/ip4/127.0.0.1/tcp/{free_port()}",
                  *RARE_ANNOUNCEMENTS)
        return start_all(local_swarm, tarpit_model, [("0:4", listen, ("-m", "swarm.server"))])[0]

    def announced(lm, peer_id: str):
        return read_servers(lm.dht, default_prefix(tarpit_model), 4).get(peer_id)

    first = on_a_new_port()
    try:  # a ban far longer than a restart takes: only lifting it lets the client reach the server again
        # the file's shared DHT peer: its daemon never dialled this model's server before, so it too knows only the
        # address the first server had
        with swarm_client(local_swarm, tarpit_model, dht=swarm_peer, retry_deadline=5.0, ban_base=120.0) as lm:
            assert lm.generate("moved", **settings).token_ids == expected.token_ids
            old_addresses = announced(lm, first.peer_id).addresses
            local_swarm.terminate(first)
            with pytest.raises(MissingBlocksError):  # the server is gone: banned as unreachable
                lm.generate("moved", **settings)
            assert not lm.sequence.health.usable(first.peer_id)
            second = on_a_new_port()
            assert second.peer_id == first.peer_id
            # The event the client needs: the server's signed record carries its new address.
            assert wait_until(lambda: (record := announced(lm, second.peer_id)) is not None
                              and record.state == ServerState.ONLINE and record.addresses != old_addresses,
                              interval=0.5)  # a DHT read each time: no faster than the records change
            started = time.monotonic()
            result = lm.generate("moved", **settings)  # the ban for the old address is lifted, not waited out
            print(f"server restarted on a new port reached again after {time.monotonic() - started:.2f} s")
            assert result.token_ids == expected.token_ids
            assert {event["peer_id"] for event in result.info["failovers"]} <= {first.peer_id}
            assert len(result.info["failovers"]) <= 1, "one call at the old address at most"
    finally:
        stop_all(local_swarm, [first, second] if "second" in locals() else [first])


# ----- spot checks without gaps --------------------------------------------------------------------------
# One model for every spot-check attack below, its servers started at once (one boot's wait, seven servers where one
# model per attack took eleven: a server is its libp2p daemon and two processes; an honest server plays its part in
# several attacks, as honest_slow does in the tarpit tests too). Each test's clients route only through the servers
# its attack names (``only_peers``, applied at once: the route shown and the checkers asked are those alone), so each
# sees exactly the holders it would see on a model of its own. Announced throughputs order each test's route (a
# route's cost is its measured round trip plus its tokens over the announced throughput); each test's first server is
# ahead of the next by 3 s of compute or more at a generation's 30 tokens (1e9 against 10, 10 against 3, 3 against
# 1), so that a loaded machine's slower ping to the faster server (its challenge answered late) cannot outweigh the
# compute it saves (at throughputs of a few thousand, 0.1 s apart, it did: routes went the other way in loaded runs).
LIARS = {  # name: (blocks, args, entry)
    "faulty": ("0:4", ("--throughput", "3"), FAULTY),  # lies on every answer
    "honest_fast": ("0:4", ("--throughput", "10"), SERVER),
    "honest_slow": ("0:4", ("--throughput", "1"), SERVER),  # no head: the head liar's replica
    "split_0_2": ("0:2", ("--throughput", "1"), SERVER),
    "split_2_4": ("2:4", ("--throughput", "1"), SERVER),
    "reuse_liar": ("0:4", ("--throughput", "1e9", "--public-name", "faulty-reuse"), FAULTY),  # lies on cache reuses
    "head_liar": ("0:4", ("--head", "--throughput", "1e9", "--public-name", "faulty-head"), FAULTY),  # on predictions
}
ATTACKS = {  # each attack's servers (the first is routed first), by fixture
    # one faulty (announced faster) and one honest server for the same blocks, and no third to break ties
    "two_holders": ("faulty", "honest_slow"),
    # a server that lies only on cache-reuse passes (announced fastest), and two honest ones
    "reuse_liar": ("reuse_liar", "honest_fast", "honest_slow"),
    # an honest server routed first, a liar for the same blocks announced slower (so every call it answers is a spot
    # check: a liar acting only as checker), and honest 0:2 + 2:4 announced slowest
    "checker_liar": ("honest_fast", "faulty", "split_0_2", "split_2_4"),
    # a ``--head`` server that lies only in its predictions beside one honest replica without the head: no other
    # server can answer a head query
    "head_liar": ("head_liar", "honest_slow"),
}


@pytest.fixture(scope="module")
def liar_models(local_swarm, tmp_path_factory):
    """The liars' model and its servers by name, all started at once when the first test needs them (a tarpit test,
    in the file's order); each attack's fixture waits for its own."""
    path = make_checkpoint(tmp_path_factory.mktemp("liars"), tiny_config(), seed=12)
    servers = {name: local_swarm.start_server(str(path), blocks, "--compute-threads", "1", *extra, *RARE_ANNOUNCEMENTS,
                                              entry=entry, name=name, wait=False)
               for name, (blocks, extra, entry) in LIARS.items()}
    yield path, servers
    stop_all(local_swarm, list(servers.values()))


@pytest.fixture(scope="module")
def liar_local(liar_models):
    """The liars' model run locally, loaded once: the tokens each test expects."""
    return DiffusionLM.from_pretrained(liar_models[0])


def liar_model(local_swarm, liar_models, attack: str):
    """The model's path and the servers of ``attack`` (waited for), in ``ATTACKS``' order."""
    path, servers = liar_models
    chosen = [servers[name] for name in ATTACKS[attack]]
    wait_all(local_swarm, chosen)
    return path, chosen


def attack_client(local_swarm, path, servers, dht, **options):
    """A client of the liars' model that routes only through ``servers`` (the attack's)."""
    lm = swarm_client(local_swarm, path, dht=dht, **options)
    lm.only_peers = frozenset(server.peer_id for server in servers)
    return lm


@pytest.fixture(scope="module")
def two_holders(local_swarm, liar_models):
    path, (faulty, honest) = liar_model(local_swarm, liar_models, "two_holders")
    return path, faulty, honest


def test_an_unresolved_check_with_no_other_route_stops_with_both_servers_named(local_swarm, two_holders, swarm_peer):
    """Two servers disagree and no third opinion exists: neither answer is used (the checker's is as unverified
    as the primary's), both are avoided, and with no other route the generation stops, naming both."""
    path, faulty, honest = two_holders
    with attack_client(local_swarm, path, [faulty, honest], swarm_peer, spot_check_fraction=1.0) as lm:
        wait_seen(lm, [faulty, honest])  # a loaded machine's DHT read can miss one, and the route then goes without it
        assert lm.show_route()[0].peer_id == faulty.peer_id
        with pytest.raises(UnverifiedResultError, match=f"unresolved: {faulty.peer_id[-8:]} and {honest.peer_id[-8:]}"
                           ".*no other route"):
            lm.generate("audit", **SETTINGS)
        first = lm.sequence.spot_checker.outcomes[0]
        assert (first.primary, first.checkers, first.verdict) == (faulty.peer_id, [honest.peer_id], "unresolved")
        assert set(lm.sequence.health.disputes()) == {faulty.peer_id, honest.peer_id}


def test_restricted_requests_stop_on_an_unresolved_check(local_swarm, two_holders, swarm_peer):
    path, faulty, honest = two_holders
    with attack_client(local_swarm, path, [faulty, honest], swarm_peer,
                       trusted_peers=(faulty.peer_id, honest.peer_id)) as lm:
        wait_seen(lm, [faulty, honest])
        assert lm.show_route()[0].peer_id == faulty.peer_id
        with pytest.raises(UnverifiedResultError, match="unresolved"):
            lm.generate("audit", tier="restricted", **SETTINGS)


@pytest.fixture(scope="module")
def reuse_liar(local_swarm, liar_models):
    path, servers = liar_model(local_swarm, liar_models, "reuse_liar")
    return path, servers


CACHED = dict(SETTINGS, cache="dual", gen_length=24, block_length=8, steps=12)


def test_reuse_passes_are_checked_and_a_reuse_liar_is_caught(local_swarm, reuse_liar, liar_local, swarm_peer):
    """The liar's fill passes agree with honest servers; only a check of a reuse pass (which first rebuilds
    the same cache on the checker) can catch it, and does."""
    path, servers = reuse_liar
    liar = servers[0]
    expected = liar_local.generate("reuse", **CACHED)
    with attack_client(local_swarm, path, servers, swarm_peer, spot_check_fraction=1.0) as lm:
        wait_seen(lm, [liar])
        assert lm.show_route()[0].peer_id == liar.peer_id
        result = lm.generate("reuse", **CACHED)
        checks = [c for c in result.info["spot_checks"] if c["primary"] == liar.peer_id]
        assert [(c["verdict"], c["reuse"]) for c in checks] == [("agreed", False), ("primary_faulty", True)]
        assert liar.peer_id in lm.sequence.distrusted
        assert result.token_ids == expected.token_ids


# ----- issue 33, item 3: liars a check must catch, and checks a liar cannot steer ---------------------------
@pytest.fixture(scope="module")
def checker_liar(local_swarm, liar_models):
    return liar_model(local_swarm, liar_models, "checker_liar")


def test_a_liar_acting_only_as_checker_cannot_take_the_honest_servers_place(local_swarm, checker_liar, liar_local,
                                                                             swarm_peer):
    """Before, the unresolved check trusted the checker: the honest server was avoided and the route moved onto
    the liar. Now both are avoided (the outcome names both), the hop is redone over the other servers, and the
    tokens are the honest ones."""
    path, servers = checker_liar
    honest, liar, *split = servers
    expected = liar_local.generate("audit", **SETTINGS)
    with attack_client(local_swarm, path, servers, swarm_peer, spot_check_fraction=1.0) as lm:
        wait_seen(lm, [honest, liar])
        assert lm.show_route()[0].peer_id == honest.peer_id
        result = lm.generate("audit", **SETTINGS)
        first = result.info["spot_checks"][0]
        assert (first["primary"], first["checkers"], first["verdict"]) == (honest.peer_id, [liar.peer_id],
                                                                           "unresolved")
        assert result.token_ids == expected.token_ids
        used = " ".join(result.info["route"])
        assert liar.peer_id[-8:] not in used and all(server.peer_id[-8:] in used for server in split)
        assert set(lm.sequence.health.disputes()) == {honest.peer_id, liar.peer_id}
        assert honest.peer_id not in result.info["distrusted"], "a dispute is no verdict against the honest server"


@pytest.fixture(scope="module")
def head_liar(local_swarm, liar_models):
    return liar_model(local_swarm, liar_models, "head_liar")


def test_a_lying_head_server_beside_a_replica_without_the_head_is_caught(local_swarm, head_liar, liar_local,
                                                                         swarm_peer):
    """Checkers of a head hop had to hold the head: every check was ``no_checker`` and the liar's tokens were the
    output. Now the replica's hidden states, scored by the client's own head, contradict the liar's predictions,
    and so do the liar's own hidden states: it is distrusted and the tokens are the honest local run's."""
    path, servers = head_liar
    liar, replica = servers
    expected = liar_local.generate("audit", **SETTINGS)
    with attack_client(local_swarm, path, servers, swarm_peer, spot_check_fraction=0) as lm:
        wait_seen(lm, [liar, replica])
        assert lm.show_route()[-1].peer_id == liar.peer_id, "the route ends on the head server"
        assert lm.generate("audit", **SETTINGS).token_ids != expected.token_ids, "unchecked, the lie is the output"
    with attack_client(local_swarm, path, servers, swarm_peer, spot_check_fraction=1.0) as lm:
        wait_seen(lm, [liar, replica])  # a replica this client missed (a lost DHT reply) leaves only its own check
        result = lm.generate("audit", **SETTINGS)
        assert result.token_ids == expected.token_ids
        first = result.info["spot_checks"][0]
        assert (first["primary"], first["checkers"], first["verdict"], first["note"]) == (
            liar.peer_id, [replica.peer_id], "primary_faulty", OWN_HIDDEN_STATES)
        assert result.info["distrusted"] == [liar.peer_id]
        later = result.info["spot_checks"][1:]  # then only the replica, recomputed on the client's own checkpoint
        assert {(c["verdict"], tuple(c["checkers"])) for c in later} <= {("agreed", ("local",))}, later


def check_schedule(local_swarm, dht, path, **options) -> list[tuple[int, tuple[int, int]]]:
    """The (step, blocks) a fresh client checked in one generation at fraction 0.5 (its draws are its own, whatever
    DHT peer it shares)."""
    with swarm_client(local_swarm, path, dht=dht, spot_check_fraction=0.5, **options) as lm:
        lm.generate("audit", **SETTINGS)
        return [(outcome.step, outcome.blocks) for outcome in lm.sequence.spot_checker.outcomes]


def test_clients_draw_their_own_check_schedules(local_swarm, tiny_model_path, swarm_peer):
    """A constant default seed let a liar learn which hops a default client never checks. Two clients with default
    settings now draw different schedules (the same one by chance: 2^-16 over the 16 hops of this generation); a
    seed still reproduces one."""
    schedules = [check_schedule(local_swarm, swarm_peer, tiny_model_path) for _ in range(2)]
    assert schedules[0] != schedules[1]
    assert check_schedule(local_swarm, swarm_peer, tiny_model_path, spot_check_seed=7) == check_schedule(
        local_swarm, swarm_peer, tiny_model_path, spot_check_seed=7)
