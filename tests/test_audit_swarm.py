"""The auditor against a real local swarm (issue 39): ``python -m swarm.audit --once`` passes an honest server and
fails a lying one (tests/faulty_server.py), a client that trusts the auditor routes around the liar while one that
trusts nobody does not, and a stranger's key cannot publish a report such a client follows."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import get_dht_time

from swarm.audit.records import FAIL, PASS, AuditReport, ServerAudit, publish_report, read_report
from swarm.dht.config import NetworkConfig
from swarm.dht.node import start_dht, stop_dht
from swarm.dht.schema import audit_key, forget_local_copies
from swarm.dht.validation import ed25519_text, sign_slot, slot_subkey
from swarm.frontend.local import DiffusionLM
from swarm.governance.keys import generate_private_key, public_key_text
from tests.conftest import make_checkpoint, stop_all, swarm_client, tiny_config

ROOT = Path(__file__).resolve().parents[1]
FAULTY = (str(Path(__file__).with_name("faulty_server.py")),)
SETTINGS = dict(gen_length=16, steps=8, block_length=8, seed=3, temperature=0.5)
PREFIX = "audit-swarm"  # the checkpoint's directory name: servers, clients and the auditor derive it alike


@pytest.fixture(scope="module")
def audited(local_swarm, tmp_path_factory):
    """An honest server and a liar (announcing itself the fastest, so that routes pick it) for every block of a model
    of their own, an auditor key, and the auditor's report after one ``--once`` round (and its wall time)."""
    path = make_checkpoint(tmp_path_factory.mktemp("audit") / PREFIX, tiny_config(), seed=11)
    honest = local_swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--throughput", "1", wait=False)
    liar = local_swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--throughput", "1e9", entry=FAULTY,
                                    name="faulty", wait=False)
    key_path = tmp_path_factory.mktemp("auditor") / "auditor.key"
    key = generate_private_key(key_path)
    try:
        for server in (honest, liar):
            local_swarm.wait_ready(server)
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "swarm.audit", "--once", "--json", "--key", str(key_path), "--model", str(path),
             "--threads", "1", *(arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer))],
            capture_output=True, text=True, timeout=240, cwd=ROOT)
        seconds = time.perf_counter() - started
        assert done.returncode == 0, done.stderr[-3000:]
        yield path, honest, liar, key, json.loads(done.stdout), seconds, done.stderr
    finally:
        stop_all(local_swarm, [honest, liar])  # their own prefix


def test_the_auditor_passes_the_honest_server_and_fails_the_liar(audited):
    path, honest, liar, key, report, seconds, log = audited
    print(f"one --once audit round of 2 servers: {seconds:.1f} s wall, the command's start included")
    assert report["prefix"] == PREFIX and report["auditor"] == public_key_text(key)
    found = {entry["peer_id"]: entry for entry in report["servers"]}
    assert found[honest.peer_id]["verdict"] == PASS and found[honest.peer_id]["passed"] == 1
    assert found[liar.peer_id]["verdict"] == FAIL and found[liar.peer_id]["failed"] == 1
    assert "wrong hidden states for blocks 0:4" in found[liar.peer_id]["reason"]
    for entry in found.values():  # measured against what each announces
        assert entry["rows"] >= 16 and entry["measured"] > 0 and entry["rtt"] > 0
    assert found[liar.peer_id]["announced"] == 1e9 and found[honest.peer_id]["announced"] == 1.0
    assert "round 1: 2 servers checked (1 pass, 1 fail, 0 error)" in log


def test_a_client_trusting_the_auditor_routes_around_the_liar_and_one_trusting_nobody_does_not(local_swarm,
                                                                                               audited):
    path, honest, liar, key, _, _, _ = audited
    expected = DiffusionLM.from_pretrained(path).generate("audit", **SETTINGS)
    with swarm_client(local_swarm, path, trusted_auditors=("none",)) as lm:
        assert lm.show_route()[0].peer_id == liar.peer_id, "without trusted auditors the liar is the first choice"
    with swarm_client(local_swarm, path, trusted_auditors=(public_key_text(key),)) as lm:
        assert [hop.peer_id for hop in lm.show_route()] == [honest.peer_id]
        result = lm.generate("audit", **SETTINGS)
        assert result.token_ids == expected.token_ids
        assert result.info["audit_failed"] == [liar.peer_id]


def test_the_health_map_shows_the_latest_trusted_audit(local_swarm, audited):
    path, honest, liar, key, _, _, _ = audited
    peers = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
    args = ["--model", str(path), "--json", *peers]
    done = subprocess.run([sys.executable, "-m", "swarm.health", *args, "--trusted-auditors", public_key_text(key)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    audits = {s["peer_id"]: s["audit"] for s in json.loads(done.stdout)["servers"]}
    assert audits[honest.peer_id]["verdict"] == PASS and audits[liar.peer_id]["verdict"] == FAIL
    done = subprocess.run([sys.executable, "-m", "swarm.health", *args, "--trusted-auditors", "none"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert all(s["audit"] is None for s in json.loads(done.stdout)["servers"])


def test_a_strangers_report_cannot_clear_the_liar_or_fail_the_honest_server(local_swarm, audited):
    """The attack: a key nobody trusts publishes a report that passes the liar and fails the honest server, in its
    own slot and forged into the auditor's. Peers refuse the forgery, readers ignore both, and a client that trusts
    the auditor keeps avoiding the liar (and only it)."""
    path, honest, liar, key, _, _, _ = audited
    stranger = Ed25519PrivateKey.generate()
    now = time.time()
    lies = (ServerAudit(liar.peer_id, 0, 4, 5, 0, 0, now - 60, now - 1, PASS, announced=1e9),
            ServerAudit(honest.peer_id, 0, 4, 0, 5, 0, now - 60, now - 1, FAIL, now - 1, "lies", announced=1.0))
    report = AuditReport(PREFIX, int(now * 1000) + 10**6, now, lies)
    auditor = ed25519_text(key)
    dht = start_dht(NetworkConfig(initial_peers=local_swarm.initial_peers, client_mode=True))
    try:
        assert publish_report(dht, stranger, report, 600) is not None  # its own slot: stored, for whoever trusts it
        expiration = get_dht_time() + 600
        forged = sign_slot(stranger, audit_key(PREFIX, auditor), report.payload(), expiration)
        dht.store(audit_key(PREFIX, auditor), forged, expiration_time=expiration, subkey=slot_subkey(key))
        forget_local_copies(dht, [audit_key(PREFIX, auditor)])
        kept = read_report(dht, PREFIX, auditor)
        assert kept is not None and kept.server(liar.peer_id).verdict == FAIL, "the auditor's own report stands"
    finally:
        stop_dht(dht)
    with swarm_client(local_swarm, path, trusted_auditors=(auditor,)) as lm:
        assert [hop.peer_id for hop in lm.show_route()] == [honest.peer_id]
        assert lm.planner.health.audit_failed.keys() == {liar.peer_id}
