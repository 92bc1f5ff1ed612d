"""Issue 24: servers behind NAT join, serve and fail over, in a lab of network namespaces (``swarm/testing/netlab.py``).

The lab tests need root, ``ip netns`` and iptables; elsewhere they are skipped with the reason, also as a warning
so that ``pytest -q`` shows it. The tests of the address rules below them run everywhere. Run with ``-s`` to see
which path each connection took and how long joining took.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from swarm.dht.nat import ALL_INTERFACES, RelayPlan, address_kind, listen_addresses, relay_plan, relay_wanted
from swarm.dht.schema import ServerRecord, ServerState
from swarm.health.map import build_health_map
from swarm.health.reachability import DIRECT, LOCAL, RELAY, UNKNOWN, reachability
from swarm.health.render import render_text
from swarm.testing.netlab import (
    PREFIX,
    ClientFailed,
    LabConfig,
    NetLab,
    clean_leftovers,
    path_kind,
    relay_wait_seconds,
    unavailable_reason,
)
from swarm.utils.forkserver import ForkedProcess
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "behind nat"
SETTINGS = dict(gen_length=16, steps=16, block_length=8, seed=5, temperature=0.7)
RELAY_ID = re.compile(r"/p2p/([^/]+)/p2p-circuit")
PUBLIC = "/ip4/44.0.0.1/tcp/31337/p2p/12D3KooWRfGU6eoW2x9xq1Rz81Bg3aF1StqG5zsTec3oM1c8PbG2"


# ----- what a newcomer reads about these tests ----------------------------------------------------------------
def test_the_readme_says_what_the_skipped_tests_need_and_ci_installs_it():
    """README's test command skips the lab without iptables: it says so, and .ci/run installs what it names."""
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    named = {pkg for line in re.findall(r"apt-get install -y ([a-z0-9 -]+)", readme) for pkg in line.split()}
    assert {"iptables", "iproute2"} <= named and "tests/test_nat.py" in readme
    installed = set(re.search(r"for pkg in ([a-z0-9 -]+); do", ci).group(1).split())
    assert named <= installed, named - installed


# ----- the address rules (no network) ------------------------------------------------------------------------
def test_address_kinds_and_server_reachability():
    circuit = f"{PUBLIC}/p2p-circuit"
    assert [address_kind(a) for a in ("/ip4/44.0.0.6/tcp/1", "/ip4/192.168.1.2/tcp/1", "/ip4/127.0.0.1/tcp/1",
                                      "/ip4/100.64.0.1/tcp/1", "/ip4/203.0.113.5/tcp/1", circuit,
                                      "/dns4/swarm.example.org/tcp/1", "/ip6/::1/tcp/1")] == \
        ["public", "private", "private", "private", "private", "relay", "public", "private"]
    assert reachability(["/ip4/127.0.0.1/tcp/5", "/ip4/192.168.1.2/tcp/5", circuit]) == RELAY
    assert reachability(["/ip4/192.168.1.2/tcp/5", "/ip4/44.0.0.9/tcp/5", circuit]) == DIRECT
    assert reachability(["/ip4/127.0.0.1/tcp/5"]) == LOCAL
    assert reachability([]) == UNKNOWN


def test_relay_plan_follows_where_the_peer_is():
    peers, loopback = [PUBLIC], ["/ip4/127.0.0.1/tcp/4000"]
    plan = relay_plan(loopback, [], peers, use_relay=True, use_auto_relay=False, client_mode=False)
    assert plan.detected and "loopback" in plan.reason and plan.relays == peers
    assert plan.daemon_options() == dict(use_relay=True, use_auto_relay=True, trusted_relays=peers,
                                         force_reachability="private", client_mode=True)
    # clients only dial out; a port forwarded by hand is announced; a LAN swarm needs no relay; no relays allowed
    assert relay_plan(loopback, [], peers, use_relay=True, use_auto_relay=False, client_mode=True) is None
    assert relay_plan(loopback, ["/ip4/44.0.0.9/tcp/4000"], peers, use_relay=True, use_auto_relay=False,
                      client_mode=False) is None
    local_peer = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWRfGU6eoW2x9xq1Rz81Bg3aF1StqG5zsTec3oM1c8PbG2"
    assert relay_plan(loopback, [], [local_peer], use_relay=True, use_auto_relay=False, client_mode=False) is None
    assert relay_plan(loopback, [], peers, use_relay=False, use_auto_relay=False, client_mode=False) is None
    # asked for by hand, not detected: AutoNAT still decides, nothing is forced
    asked = relay_plan(["/ip4/44.0.0.9/tcp/0"], [], peers, use_relay=True, use_auto_relay=True, client_mode=False)
    assert asked == RelayPlan("--use-auto-relay", peers, detected=False)
    assert "force_reachability" not in asked.daemon_options()


def test_a_relay_runs_unless_the_whole_swarm_is_on_this_machine():
    """A circuit relay only costs CPU where no peer can be behind a NAT: listening on loopback with every initial
    peer on loopback. Anything else, or an explicit choice, keeps what is asked (tests/test_daemons.py checks the
    daemons)."""
    loopback, local_peer = ["/ip4/127.0.0.1/tcp/0"], "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWRfGU6eoW2x9xq1Rz81Bg3aF1"
    assert not relay_wanted(None, loopback, []) and not relay_wanted(None, loopback, [local_peer])
    assert not relay_wanted(None, ["/ip6/::1/tcp/0"], ["/dns4/localhost/tcp/1/p2p/x"])
    assert relay_wanted(None, loopback, [PUBLIC]), "a peer reaching a public swarm may need relays to reach servers"
    assert relay_wanted(None, loopback, [local_peer, "/ip4/192.168.1.5/tcp/1/p2p/x"]), "a LAN peer: maybe NATed"
    assert relay_wanted(None, ["/ip4/0.0.0.0/tcp/0"], [local_peer]), "other machines can dial it"
    assert relay_wanted(None, [], [])
    assert relay_wanted(True, loopback, []) and not relay_wanted(False, ["/ip4/0.0.0.0/tcp/0"], [PUBLIC])


def test_the_loopback_default_follows_the_swarm():
    default = ["/ip4/127.0.0.1/tcp/0"]
    assert listen_addresses(default, default, [PUBLIC]) == list(ALL_INTERFACES)
    assert listen_addresses(default, default, ["/ip4/127.0.0.1/tcp/1/p2p/x"]) == default  # a local swarm
    assert listen_addresses(["/ip4/127.0.0.1/tcp/4000"], default, [PUBLIC]) == ["/ip4/127.0.0.1/tcp/4000"]


def test_health_table_says_how_each_server_is_reached():
    def record(peer: str, start: int, end: int, addresses: list[str]) -> ServerRecord:
        return ServerRecord(peer, ServerState.ONLINE, start, end, 10.0, addresses=addresses)

    health = build_health_map([record("natted", 0, 2, ["/ip4/192.168.1.2/tcp/5", f"{PUBLIC}/p2p-circuit"]),
                               record("public", 2, 4, ["/ip4/44.0.0.9/tcp/5"])], "m", 4)
    assert [s["reachability"] for s in health.to_json()["servers"]] == [RELAY, DIRECT]
    lines = render_text(health).splitlines()
    assert "REACH" in lines[2]
    # the columns after REACH (adapters, the latest trusted audit) are empty here ("-")
    assert re.search(r"0:2 .* relay( +-)+ +natted$", lines[3]) and re.search(r"2:4 .* direct( +-)+ +public$", lines[4])


# ----- the lab -----------------------------------------------------------------------------------------------
REASON = unavailable_reason()


def require_lab() -> None:
    if REASON:
        warnings.warn(f"NAT lab tests skipped: {REASON}")
        pytest.skip(f"NAT lab unavailable: {REASON}")


@pytest.fixture(scope="module")
def lab():
    """Four public machines (bootstrap and relays), four homes behind NAT (home4's router randomizes ports, so
    hole punching cannot work there) and a client's home. The relay test kills a public peer and starts it again
    with the same identity and port, so the tests after it (in any order) find the lab as it was."""
    require_lab()
    with NetLab(LabConfig(homes=4, client_homes=1, symmetric_nat=("home4",))) as built:
        began = time.monotonic()
        built.start_public_peers()
        print(f"\n[nat] {len(built.initial_peers)} public peers up in {time.monotonic() - began:.1f} s")
        yield built


@pytest.fixture(scope="module")
def local_tokens() -> list[int]:
    from swarm.frontend.local import DiffusionLM

    return DiffusionLM.from_pretrained("default").generate(PROMPT, **SETTINGS).token_ids


def start_servers(lab: NetLab, placements: list[tuple[str, str]], prefix: str) -> dict[str, dict]:
    """Servers started together; per peer id: its process, role, and join time (start to serving, the relay
    reservation included) with the relay wait its log reports."""
    began = time.monotonic()
    started = [(role, lab.start_server(role, blocks, "--dht-prefix", prefix, wait=False))
               for role, blocks in placements]
    servers = {}
    for role, process in started:
        lab.wait_ready(process)
        servers[process.peer_id] = {"process": process, "role": role, "joined_s": time.monotonic() - began,
                                    "relay_wait_s": relay_wait_seconds(process)}
        print(f"[nat] {role} {process.span} joined in {servers[process.peer_id]['joined_s']:.1f} s "
              f"(relay reservation after {servers[process.peer_id]['relay_wait_s']} s)")
    return servers


def stop_servers(lab: NetLab, servers: dict[str, dict]) -> None:
    """SIGKILL (each with its daemons): every test's servers have a DHT prefix of their own that no later test reads,
    and a graceful stop takes 1-3 s apiece to announce OFFLINE."""
    for server in servers.values():
        if server["process"].alive:
            lab.terminate(server["process"], signal.SIGKILL)


def client_args(prefix: str, *extra: str) -> list[str]:
    return ["--dht-prefix", prefix, "--prompt", PROMPT, "--settings", json.dumps(SETTINGS), *extra]


def report_paths(paths: dict[str, list[str]], servers: dict[str, dict]) -> dict[str, str]:
    kinds = {}
    for peer_id, server in servers.items():
        kinds[peer_id] = path_kind(paths.get(peer_id, []))
        print(f"[nat] client -> {server['role']}: {kinds[peer_id]} via {', '.join(paths.get(peer_id, [])) or '-'}")
    return kinds


def start_health(lab: NetLab, prefix: str) -> ForkedProcess:
    """``python -m swarm.health --json`` on the client's machine; :func:`read_health` reads what it printed."""
    peers = [arg for peer in lab.initial_peers for arg in ("--initial-peers", peer)]
    return lab.start_python("client1", ["-m", "swarm.health", *peers, "--dht-prefix", prefix, "--num-blocks", "16",
                                        "--json"])


def read_health(shown: ForkedProcess) -> dict:
    """The JSON object it printed (its log, on the same pipe, around it)."""
    out = shown.stdout.read()
    assert shown.wait(60) == 0, out[-2000:]
    start = 0 if out.startswith("{") else out.index("\n{") + 1
    return json.JSONDecoder().raw_decode(out, start)[0]


def test_lab_routers_translate_and_refuse_inbound(lab):
    """The NAT is real: the internet sees the router's address, and nothing dials into a home."""
    listen = ("import socket; s = socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen(); s.settimeout(8); "
              "print('LISTENING', flush=True); print(s.accept()[1][0], flush=True)")

    def dial(role: str, address: str) -> subprocess.Popen:
        code = f"import socket; socket.create_connection(('{address}', 7000), timeout=2)"
        return lab.popen(role, ["-c", code], stderr=subprocess.DEVNULL)

    def listening(role: str) -> subprocess.Popen:
        listener = lab.popen(role, ["-c", listen], stdout=subprocess.PIPE, text=True)
        assert listener.stdout.readline().strip() == "LISTENING"  # bound: no dial can come before the listener
        return listener

    listener = listening("pub2")
    assert dial("home1", lab.machines["pub2"].address).wait(10) == 0
    assert listener.communicate(timeout=10)[0].strip() == lab.machines["home1"].public_address
    listener = listening("home1")
    try:
        # Each refused dial waits out its 2 s timeout (the routers drop, they do not reset): they run at once.
        refused = [dial("pub2", lab.machines["home1"].public_address),
                   dial("home2", lab.machines["home1"].public_address),
                   dial("home2", lab.machines["home1"].address)]  # a private address of another home
        assert [dialer.wait(10) != 0 for dialer in refused] == [True, True, True]
    finally:
        listener.kill()


@pytest.mark.lab
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_lab_leaves_nothing_behind(sig):
    """Whatever ends a lab's process, its namespaces and processes go: at once on SIGTERM and Ctrl-C, and after
    SIGKILL by the next lab (``clean_leftovers``, also ``python -m swarm.testing.netlab clean``)."""
    require_lab()
    # Python's own Ctrl-C handler, whatever this process left its children (an ignored SIGINT is inherited)
    script = ("import signal, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "from swarm.testing.netlab import LabConfig, NetLab\n"
              "with NetLab(LabConfig(homes=1, client_homes=0, public_peers=1)) as lab:\n"
              "    sleeper = lab.popen('home1', ['-c', 'import time; time.sleep(600)'])\n"
              "    print(sleeper.pid, flush=True)\n    time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    sleeper = int(owner.stdout.readline())
    names = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
             if n.startswith(f"{PREFIX}{owner.pid}-")]
    assert len(names) == 4  # wan, pub1, rtr1, home1
    owner.send_signal(sig)
    owner.wait(30)
    if sig == signal.SIGKILL:
        assert set(clean_leftovers()) >= set(names)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in names if n in left]
    assert not list(Path(tempfile.gettempdir()).glob(f"{PREFIX}{owner.pid}-*")), "its folder of identity keys"
    assert process_ends(sleeper)


def process_ends(pid: int, timeout: float = 10.0) -> bool:
    """Whether ``pid`` is gone (or a zombie waiting for init to reap it) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_client_behind_nat_generates_through_two_natted_servers(lab, local_tokens):
    servers = start_servers(lab, [("home1", "0:8"), ("home2", "8:16")], "nat-serve")
    try:
        began = time.monotonic()
        client = lab.start_client("client1", *client_args("nat-serve"))
        health = start_health(lab, "nat-serve")  # beside the client: the servers announced their addresses when ready
        print(f"[nat] client joined the DHT in {client.wait_for('JOINED', 60)['seconds']:.1f} s")
        result = client.wait_for("RESULT", 90)
        print(f"[nat] first generation done {time.monotonic() - began:.1f} s after the client started")
        assert result["runs"][0]["token_ids"] == local_tokens
        assert {hop["peer_id"] for hop in result["route"]} == set(servers)
        kinds = report_paths(result["paths"], servers)
        assert set(kinds.values()) <= {"direct", "relayed"}, kinds  # the client holds a connection to each hop
        health = {s["peer_id"]: s for s in read_health(health)["servers"]}
        for peer_id in servers:  # what `python -m swarm.health` shows: behind NAT, reached through relays
            assert health[peer_id]["reachability"] == RELAY, health[peer_id]["addresses"]
    finally:
        stop_servers(lab, servers)


def test_natted_server_killed_mid_run_a_replica_behind_another_nat_takes_over(lab, local_tokens):
    """Its own servers and prefix (a shared pair would be broken by the kill for a test that runs after it: the
    shuffled run found the order dependence)."""
    servers = start_servers(lab, [("home1", "0:8"), ("home2", "8:16"), ("home3", "0:8")], "nat-failover")
    try:
        client = lab.start_client("client1", *client_args("nat-failover", "--hold-at-step", "3"))
        held = client.wait_for("HELD", 90)
        victim = next(hop["peer_id"] for hop in held["route"] if hop["span"] == [0, 8])
        lab.terminate(servers[victim]["process"], signal.SIGKILL)
        print(f"[nat] killed {servers[victim]['role']} (0:8) at step {held['step']}")
        client.release()
        result = client.wait_for("RESULT", 90)
        assert result["runs"][0]["token_ids"] == local_tokens
        assert victim in {event["peer_id"] for event in result["runs"][0]["failovers"]}
        replica = next(hop["peer_id"] for hop in result["route"] if hop["span"] == [0, 8])
        assert replica != victim and servers[replica]["role"] != servers[victim]["role"]
        report_paths(result["paths"], {p: s for p, s in servers.items() if p != victim})
    finally:
        stop_servers(lab, servers)


def test_relay_lost_mid_run_is_survived(lab, local_tokens):
    """home4's router randomizes ports, so its server is reached only through a relay. That relay dies mid-run:
    the server holds a reservation on a second relay, and the client's next call goes through it."""
    servers = start_servers(lab, [("home4", "0:16")], "nat-relay")
    (server_id, server), = servers.items()
    relay = None
    try:
        client = lab.start_client("client1", *client_args("nat-relay", "--hold-at-step", "3"))
        held = client.wait_for("HELD", 90)
        path = held["paths"].get(server_id, [])
        assert path_kind(path) == "relayed", f"a symmetric NAT should leave only relayed paths, got {path}"
        relay_id = RELAY_ID.search(path[0]).group(1)
        relay = next(p for p in lab.public_processes() if p.peer_id == relay_id)
        lab.terminate(relay, signal.SIGKILL)
        print(f"[nat] killed relay {relay.name} while the client was at step {held['step']}")
        # The loss must reach the client before its next call: a call that races it meets "stream reset" on the
        # dead circuit, and a client does not ask a peer that failed again within the call (the only server here:
        # MissingBlocksError; seen under load). Wait for the event, the relayed connection closed, not a time.
        killed = time.monotonic()
        assert wait_until(lambda: not any(relay_id in address for address in client.paths().get(server_id, [])),
                          timeout=60, interval=0.5), "the client kept its connection through the dead relay"
        print(f"[nat] the client's circuit through it closed {time.monotonic() - killed:.1f} s after the kill")
        client.release()
        try:
            result = client.wait_for("RESULT", 90)
        except ClientFailed as failure:  # allowed by the issue if it says what failed; the lab shows it survives
            pytest.fail(f"the run did not survive losing its relay: {failure}")
        assert result["runs"][0]["token_ids"] == local_tokens
        now = result["paths"][server_id]
        assert now and not any(relay_id in address for address in now), now
        report_paths(result["paths"], servers)
    finally:
        stop_servers(lab, servers)
        if relay is not None:  # the lab as it was for the tests after this one
            lab.restart_public_peer(relay)
