"""Liars that lie only where nobody used to look (issue 48, item 4): on a session's later calls, on head queries, on
cache fills and reuses, on adapter calls (``tests/faulty_server.py``'s ``faulty-later``, ``-head``, ``-cache``,
``-adapter``). An auditor's single fresh first call passes every one of them (the attack, kept as the first test);
its whole generations with a sample of every call recomputed fail each one; a default client that is the only
holder's caller catches them by recomputing its drawn hops on its own checkpoint, and one that cannot recompute says
its tokens are unchecked instead of returning them as checked."""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarm.adapters.adapter import base_of, new_adapter
from swarm.audit.auditor import Auditor
from swarm.audit.config import AuditorConfig
from swarm.audit.traffic import GEN_LENGTH, generations_to_catch
from swarm.client.proofs import Verdict
from swarm.client.spot_check import NO_CHECKER
from swarm.dht.config import NetworkConfig
from swarm.models.loading import ModelFiles
from swarm.reports.records import FAIL, PASS
from swarm.wire.evidence import CallEvidence
from swarm.wire.handoff import MAX_PER_HANDOFF, hand_evidence
from swarm.wire.messages import RemoteError
from tests.conftest import RARE_ANNOUNCEMENTS, make_checkpoint, stop_all, swarm_client, tiny_config, wait_all

FAULTY = (str(Path(__file__).with_name("faulty_server.py")),)
PREFIX = "audit-traffic"  # the checkpoint's directory name: servers, clients and the auditor derive it alike
MODES = ("faulty-later", "faulty-head", "faulty-cache", "faulty-adapter")
# What a default client needs to send for each liar to have something to lie on
CLIENT_OPTIONS = {"faulty-later": {}, "faulty-head": {}, "faulty-cache": {"cache": "dual"}, "faulty-adapter": None}
SETTINGS = dict(gen_length=16, steps=16, block_length=8, seed=5, temperature=0.0, stop_at_eos=False)


@pytest.fixture(scope="module")
def liars(local_swarm, tmp_path_factory):
    """An honest head server and one liar of each mode, every one holding the whole model with its head."""
    path = make_checkpoint(tmp_path_factory.mktemp("traffic") / PREFIX, tiny_config(), seed=21)
    common = ("--compute-threads", "1", "--head", *RARE_ANNOUNCEMENTS)
    servers = {"honest": local_swarm.start_server(str(path), "0:4", *common, name="honest", wait=False)}
    for mode in MODES:
        servers[mode] = local_swarm.start_server(str(path), "0:4", *common, "--public-name", mode, entry=FAULTY,
                                                 name=mode, wait=False)
    try:
        wait_all(local_swarm, list(servers.values()))
        yield path, {name: server.peer_id for name, server in servers.items()}
    finally:
        stop_all(local_swarm, list(servers.values()))


@pytest.fixture(scope="module")
def caller_peer(local_swarm):
    """A client's DHT peer of its own beside ``swarm_peer`` (a DHT process and a libp2p daemon, so one for the
    module): the client that hands its calls to an auditor on ``swarm_peer``, and the long-lived client whose calls
    the long-seen liar tells from the auditors' (it serves that liar nothing before its test)."""
    from swarm.dht.node import start_dht, stop_dht

    dht = start_dht(NetworkConfig(initial_peers=local_swarm.initial_peers, client_mode=True))
    yield dht
    stop_dht(dht)


AUDIT_GEN_LENGTH = 16  # tokens of the audit generations here: every kind of call, each liar's lie missed 2^-15 at most


def audit_round(local_swarm, dht, path: Path, generations: int) -> dict[str, str]:
    """One round of an in-process auditor on the DHT peer ``dht``, from its identity: each server's verdict (and
    reason) by peer id. Its generations are ``AUDIT_GEN_LENGTH`` long, half the default: the kinds of call they hold,
    not their count, are the point here (the default count's odds:
    ``test_the_stated_number_of_generations_follows_from_the_sample``)."""
    network = NetworkConfig(initial_peers=local_swarm.initial_peers, client_mode=True)
    config = AuditorConfig(network=network, fresh_identity=False, once=True, generations=generations)
    with Auditor(config, Ed25519PrivateKey.generate(), ModelFiles(path), dht=dht) as auditor:
        auditor.traffic.gen_length = AUDIT_GEN_LENGTH
        result = auditor.run_round(score=False)
    return {peer: (check.verdict, check.reason) for peer, check in result.checked.items()}


def test_a_fresh_first_call_passes_every_quiet_liar_and_whole_generations_fail_each(local_swarm, liars, swarm_peer):
    """The attack: the auditor's old single challenge (``--generations 0``) passes all four liars. The defence: two
    generations per server (a cache mode and an adapter each in turn) fail each liar and pass the honest server."""
    path, peers = liars
    old = audit_round(local_swarm, swarm_peer, path, generations=0)
    assert {name: old[peer][0] for name, peer in peers.items()} == dict.fromkeys(peers, PASS), old
    new = audit_round(local_swarm, swarm_peer, path, generations=2)
    verdicts = {name: new[peer][0] for name, peer in peers.items()}
    assert verdicts == {"honest": PASS, **dict.fromkeys(MODES, FAIL)}, new
    reasons = {name: new[peer][1] for name, peer in peers.items()}
    assert "head" in reasons["faulty-head"] and "adapter" in reasons["faulty-adapter"], reasons
    assert "fill" in reasons["faulty-cache"] or "reuse" in reasons["faulty-cache"], reasons


def test_a_liar_is_proven_on_a_clients_calls_handed_over_the_network(local_swarm, liars, swarm_peer, caller_peer):
    """Issue 55: a client hands its sampled calls to an auditor over libp2p (``evidence_auditors``, each piece with a
    work stamp), not as files; the auditor's round recomputes them and fails the liar on its own signature, keeping
    the proofs; the honest server, named by no receipt, passes. A stranger's unpaid piece is refused."""
    path, peers = liars
    network = NetworkConfig(initial_peers=local_swarm.initial_peers, client_mode=True)
    config = AuditorConfig(network=network, fresh_identity=False, once=True, generations=0)
    with Auditor(config, Ed25519PrivateKey.generate(), ModelFiles(path), dht=swarm_peer) as auditor:
        auditor_id = str(auditor.p2p.peer_id)
        with swarm_client(local_swarm, path, dht=caller_peer, spot_check_fraction=0, spot_check_local=False,
                          audit_share=1.0, evidence_auditors=(auditor_id,)) as lm:
            lm.only_peers = frozenset({peers["faulty-later"]})
            lm.generate("1+2=", **dict(SETTINGS, steps=4))  # its sample goes to the auditor in the background
            assert lm.hand_audit_sample() == {auditor_id: 0}  # waits for that hand-off: nothing is left to hand
            assert 0 < auditor.handed.queued <= MAX_PER_HANDOFF and not lm.audit_sample()  # a random choice of 8
            with pytest.raises(RemoteError, match="work stamp"):
                lm.loop.run(hand_evidence(lm.p2p, auditor_id, b"not even evidence", False, 30))
        checked = auditor.run_round(score=False).checked
        assert checked[peers["faulty-later"]].verdict == FAIL, checked
        assert "proven on a client's call" in checked[peers["faulty-later"]].reason, checked
        assert checked[peers["honest"]].verdict == PASS
        assert auditor.proofs and {proof.accused for proof in auditor.proofs} == {peers["faulty-later"]}
        assert auditor.handed.info()["refused"] == {"bad_request": 1}


@pytest.mark.parametrize("mode", MODES)
def test_a_default_client_alone_with_a_quiet_liar_catches_it_on_its_own_checkpoint(local_swarm, liars, swarm_peer,
                                                                                    mode, tmp_path):
    """A client with default settings (spot_check_fraction 0.05, a seeded schedule for a reproducible test) whose only
    route is the liar: the drawn hops are recomputed on the client's own checkpoint (no second holder exists), the
    liar is distrusted and named. Before: every drawn check was ``no_checker`` and the lies were returned."""
    path, peers = liars
    with swarm_client(local_swarm, path, dht=swarm_peer, spot_check_seed=7) as lm:
        assert lm.client_config.spot_check_fraction == 0.05
        lm.only_peers = frozenset({peers[mode]})
        options = dict(CLIENT_OPTIONS[mode] or {"adapter": str(deep_prompt(lm, tmp_path))})
        caught = []
        for _ in range(generations_to_catch(0.05, 1.0, SETTINGS["steps"], confidence=0.999)):
            try:
                result = lm.generate("1+2=", **SETTINGS, **options)
            except Exception as error:  # after the catch the liar is distrusted: no route is left
                assert peers[mode] in lm.sequence.distrusted, error
                break
            caught += [o for o in result.info["spot_checks"] if o["verdict"] == "primary_faulty"]
            if caught:
                break
        outcomes = [o for o in lm.sequence.spot_checker.outcomes if o.verdict == "primary_faulty"]
        assert outcomes and outcomes[0].primary == peers[mode] and outcomes[0].checkers == ["local"], mode
        assert peers[mode] in lm.sequence.distrusted
        # the caught call, signed by the liar, is a proof (issue 55): whatever it carried (a later step, a head
        # query, a cache reuse with its fill, an adapter), its bytes recomputed elsewhere convict the liar
        assert lm.proofs and {proof.accused for proof in lm.proofs} == {peers[mode]}, mode
        finding = lm.accept_proof(CallEvidence.from_bytes(lm.proofs[0].to_bytes()))
        assert finding.verdict == Verdict.LIE, finding


def test_a_client_that_cannot_recompute_says_its_tokens_are_unchecked(local_swarm, liars, swarm_peer, caplog):
    """Without a second holder and without recomputing (``spot_check_local=False``, as a client that holds only the
    embedding and head), drawn checks are ``no_checker``: the result counts them in ``info["unchecked"]`` and the
    first is logged as a warning, so the tokens are never presented as checked."""
    path, peers = liars
    with swarm_client(local_swarm, path, dht=swarm_peer, spot_check_fraction=0.25, spot_check_seed=3,
                      spot_check_local=False) as lm:
        lm.only_peers = frozenset({peers["faulty-later"]})
        with caplog.at_level(logging.WARNING, logger="swarm.client.spot_check"):
            result = lm.generate("1+2=", **SETTINGS)
    drawn = [o for o in result.info["spot_checks"] if o["verdict"] == NO_CHECKER]
    assert drawn and result.info["unchecked"] == len(drawn)
    assert any("unchecked" in record.getMessage() for record in caplog.records)


def test_a_client_recomputes_only_what_fits_its_check_memory(local_swarm, liars, swarm_peer):
    """``spot_check_memory_mb`` bounds the weights a client's checks load (issue 54): below the size of the blocks,
    the client alone with a liar loads nothing, and every drawn check is counted unchecked with the reason (at
    LLaDA-8B's widths, where one block is past the default bound: tests/test_invariance.py)."""
    path, peers = liars
    with swarm_client(local_swarm, path, dht=swarm_peer, spot_check_fraction=0.25, spot_check_seed=3,
                      spot_check_memory_mb=0.01) as lm:
        lm.only_peers = frozenset({peers["faulty-later"]})
        result = lm.generate("1+2=", **SETTINGS)
        assert lm.sequence.spot_checker.memory.loaded == 0 and lm._head is None
    drawn = result.info["spot_checks"]
    assert drawn and all(o["verdict"] == NO_CHECKER and "spot_check_memory_mb" in o["note"] for o in drawn), drawn
    assert result.info["unchecked"] == len(drawn)


@pytest.mark.unit
def test_check_memory_counts_each_load_once_and_the_held_head_as_free():
    """The bound adds what each allowed check loads; a head the client already holds costs nothing; a check past
    the bound is refused with the figures, and loads nothing."""
    from swarm.client.check_memory import CheckMemory, MiB

    held = []
    memory = CheckMemory(1.0, lambda start, end: (end - start) * 300 * 1024, lambda: 600 * 1024, lambda: bool(held))
    assert memory.take((0, 1), False, "recomputing blocks 0:1") is None and memory.loaded == 300 * 1024
    refused = memory.take((1, 2), True, "recomputing blocks 1:2 and the head")
    assert refused is not None and "spot_check_memory_mb (1 MiB, 0 loaded)" in refused
    assert memory.loaded == 300 * 1024
    held.append(True)  # the client's head is loaded for its own use: scoring with it loads nothing more
    assert memory.take(None, True, "scoring") is None and memory.loaded == 300 * 1024
    assert memory.take((1, 3), False, "recomputing blocks 1:3") is None and memory.loaded == 900 * 1024
    assert memory.take((3, 4), False, "recomputing blocks 3:4") is not None and memory.loaded < MiB


def deep_prompt(lm, directory: Path) -> Path:
    """A small random deep prompt for ``lm``'s model, saved under ``directory``."""
    import torch

    generator = torch.Generator().manual_seed(1)
    adapter = new_adapter("deep_prompt", 2, lm.config, base_of(lm.config, lm.tokenizer), lm.embedding, generator)
    return adapter.save(directory / "deep")


def test_the_stated_number_of_generations_follows_from_the_sample():
    """The arithmetic docs/AUDIT.md states: at the default sample 0.5, a 1-in-20 liar is caught with probability 0.99
    within 6 audit generations of 32 calls through it."""
    assert GEN_LENGTH == 32
    assert generations_to_catch(0.5, 0.05, GEN_LENGTH) == 6
    assert 1 - (1 - 0.5 * 0.05) ** (GEN_LENGTH * 6) >= 0.99 > 1 - (1 - 0.5 * 0.05) ** (GEN_LENGTH * 5)


@pytest.mark.unit
def test_the_local_reference_answers_what_a_server_computes(tmp_path):
    """The trusted recomputation restates the server's own (``SpanBackend.forward_sync``) for every kind of call: a
    plain call, a cache fill and a reuse of it, a head query over a reuse's rows, an adapter's slices; to the bit."""
    import torch

    from swarm.client.reference import LocalReference
    from swarm.diffusion.pipeline import CacheDirective
    from swarm.diffusion.prediction import HeadQuery
    from swarm.models.kv_cache import SpanKV
    from swarm.server.backend import SpanBackend, SpanCall
    from swarm.wire.messages import ForwardRequest

    files = ModelFiles(make_checkpoint(tmp_path / "reference", tiny_config(), seed=4))
    config = files.config
    backend = SpanBackend(files.span(1, config.num_layers), 1, head=files.head())
    reference = LocalReference(lambda start, end: files.span(start, end), files.head, config.num_layers)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 12, config.hidden_size, generator=generator)
    fresh = torch.randn(1, 4, config.hidden_size, generator=generator)
    adapter = new_adapter("deep_prompt", 2, config, base_of(config, files.tokenizer()), files.embedding(), generator)
    with torch.no_grad():
        adapter.prompts.add_(torch.randn(adapter.prompts.shape, generator=generator))
    piece = adapter.block_adapter.slice(1, config.num_layers)
    end = config.num_layers
    query = HeadQuery((4,), 4, (0,), seed=1, temperature=0.5, cfg_scale=0.0, mask_token_id=config.mask_token_id,
                      scored=(4, 8))
    kv = SpanKV(1, 12)
    served = {
        "plain": backend.forward_sync(SpanCall(hidden, 1, end)),
        "adapter": backend.forward_sync(SpanCall(hidden, 1, end, adapter=piece)),
        "fill": backend.forward_sync(SpanCall(hidden, 1, end, kv)),
    }
    served["reuse+head"] = backend.forward_sync(SpanCall(fresh, 1, end, kv, (4, 8), query))
    asked = {
        "plain": ForwardRequest(1, end, hidden, "s", 0),
        "adapter": ForwardRequest(1, end, hidden, "s", 0, adapter=piece),
        "fill": ForwardRequest(1, end, hidden, "s", 0, cache=CacheDirective(0)),
        "reuse+head": ForwardRequest(1, end, fresh, "s", 1, cache=CacheDirective(0, (4, 8)), head=query),
    }
    for kind, request in asked.items():
        fill = hidden if kind == "reuse+head" else None
        assert torch.equal(reference.answer(request, fill), served[kind]), kind


# ----- issue 55, class 5: audits of real traffic ------------------------------------------------------------------
SEEN_S = 10  # faulty-seen10 lies to callers it first served this long ago or more
REAL = dict(gen_length=16, steps=16, block_length=8, temperature=0.0, stop_at_eos=False, cache="none")


@pytest.fixture(scope="module")
def quiet_liars(local_swarm, tmp_path_factory):
    """An honest server, a server lying only to long-seen callers, one lying only on rows it merged across clients."""
    path = make_checkpoint(tmp_path_factory.mktemp("real") / "audit-real", tiny_config(), seed=22)
    common = ("--compute-threads", "1", *RARE_ANNOUNCEMENTS)
    servers = {"honest": local_swarm.start_server(str(path), "0:4", *common, name="honest-real", wait=False),
               "seen": local_swarm.start_server(str(path), "0:4", *common, "--public-name", f"faulty-seen{SEEN_S}",
                                                entry=FAULTY, name="seen", wait=False),
               "merged": local_swarm.start_server(str(path), "0:4", *common, "--batching", "--public-name",
                                                  "faulty-merged", entry=FAULTY, name="merged", wait=False)}
    try:
        wait_all(local_swarm, list(servers.values()))
        yield path, {name: server.peer_id for name, server in servers.items()}
    finally:
        stop_all(local_swarm, list(servers.values()))


def recompute(path: Path, sample: list) -> list:
    """What an auditor holding every block finds in a client's sample (a fresh copy of the checkpoint each time)."""
    from swarm.client.proofs import verify_evidence
    from swarm.client.reference import LocalReference
    from swarm.dht.schema import default_prefix

    files = ModelFiles(path)
    reference = LocalReference(lambda start, end: files.span(start, end), files.head, files.config.num_layers)
    return [verify_evidence(evidence, reference, default_prefix(path), files.config) for evidence in sample]


def test_a_liar_to_long_seen_callers_is_proven_on_a_long_lived_clients_own_calls(local_swarm, quiet_liars,
                                                                                 swarm_peer, caller_peer, tmp_path):
    """The attack: audit rounds from new identities pass it, and a client without the blocks (no spot check possible)
    gets its lies. The defence: an auditor whose traffic identity lives across rounds (the default) is lied to and
    fails it; the client's sampled calls, signed by the liar and handed to an auditor (``--evidence-dir``), are
    proofs: the auditor fails the liar on them and keeps them, and a bystander holding the checkpoint verifies one
    on its own and routes around the liar. The first generation's calls (honest) accuse nobody.

    The liar keeps one clock per caller, so the three callers (an auditor renewing its identity every round, one
    keeping it, a long-lived client with a DHT peer of its own: ``caller_peer``) each make their first round or
    generation, then one wait past ``SEEN_S`` serves all three (it was one wait each). The auditors' rounds send
    their challenges only (``generations=0``): the identity a call comes from is the point, and a round's generations
    come from the same identity as its challenges (the first test runs them); the auditor the evidence is handed to
    challenges from the shared DHT peer, which the liar has never served, so its challenges pass and only the proofs
    can fail it."""
    path, peers = quiet_liars
    network = NetworkConfig(initial_peers=local_swarm.initial_peers, client_mode=True)
    config = AuditorConfig(network=network, generations=0)
    fresh = dataclasses.replace(config, identity_lifetime=0)
    inbox = tmp_path / "inbox"
    files = ModelFiles(path)
    with Auditor(fresh, Ed25519PrivateKey.generate(), files, dht=swarm_peer) as renewing, \
            Auditor(config, Ed25519PrivateKey.generate(), files, dht=swarm_peer) as keeping, \
            swarm_client(local_swarm, path, dht=caller_peer, spot_check_fraction=0, spot_check_local=False,
                         audit_share=1.0) as lm:
        assert renewing.run_round(score=False).checked[peers["seen"]].verdict == PASS  # the attack
        first = keeping.run_round(score=False).checked[peers["seen"]]
        lm.only_peers = frozenset({peers["seen"]})
        lm.generate("1+2=", **REAL, seed=1)
        honest_calls = len(lm.save_audit_sample(inbox))
        time.sleep(SEEN_S + 1)
        assert renewing.run_round(score=False).checked[peers["seen"]].verdict == PASS  # a new identity again
        assert (first.verdict, keeping.run_round(score=False).checked[peers["seen"]].verdict) == (PASS, FAIL)
        lm.generate("1+2=", **REAL, seed=2)
        later_calls = len(lm.save_audit_sample(inbox))
    assert honest_calls and later_calls
    handed = dataclasses.replace(fresh, fresh_identity=False, evidence_dir=str(inbox))
    with Auditor(handed, Ed25519PrivateKey.generate(), files, dht=swarm_peer) as auditor:
        checked = auditor.run_round(score=False).checked
    assert checked[peers["seen"]].verdict == FAIL and "proven" in checked[peers["seen"]].reason, checked
    assert checked[peers["honest"]].verdict == PASS
    proofs = sorted((inbox / "proofs").glob("*.evidence"))
    assert 0 < len(proofs) <= later_calls and not list(inbox.glob("*.evidence"))  # honest calls were removed
    with swarm_client(local_swarm, path, dht=swarm_peer, spot_check_fraction=0) as bystander:
        finding = bystander.accept_proof(CallEvidence.from_bytes(proofs[0].read_bytes()))
        assert (finding.verdict, finding.accused) == (Verdict.LIE, peers["seen"])
        assert peers["seen"] in bystander.sequence.distrusted
        bystander.only_peers = frozenset({peers["seen"], peers["honest"]})
        bystander.generate("1+2=", **REAL, seed=3)
        assert {hop.peer_id for hop in bystander.planner.route} == {peers["honest"]}


def test_a_liar_on_merged_rows_is_proven_on_concurrent_clients_own_calls(local_swarm, quiet_liars, swarm_peer):
    """The attack: an audit round alone on the server passes it (nothing to merge). The defence: concurrent clients'
    sampled calls, merged on the server, recomputed by an auditor: the merged rows' receipts are proofs; its passes
    alone verify honest, so nobody is accused for them. The round challenges from the shared DHT peer (the liar tells
    callers apart only by what it merges); the clients share it too, as the calls of one generation each, started
    together, queue and merge."""
    from concurrent.futures import ThreadPoolExecutor

    path, peers = quiet_liars
    network = NetworkConfig(initial_peers=local_swarm.initial_peers, client_mode=True)
    config = AuditorConfig(network=network, once=True, generations=1, fresh_identity=False)
    with Auditor(config, Ed25519PrivateKey.generate(), ModelFiles(path), dht=swarm_peer) as auditor:
        auditor.traffic.gen_length = AUDIT_GEN_LENGTH
        assert auditor.run_round(score=False).checked[peers["merged"]].verdict == PASS  # the attack

    def client_sample(seed: int) -> list:
        with swarm_client(local_swarm, path, dht=swarm_peer, spot_check_fraction=0, spot_check_local=False,
                          audit_share=1.0) as lm:
            lm.only_peers = frozenset({peers["merged"]})
            lm.generate("1+2=", **REAL, seed=seed)
            return lm.audit_sample()

    with ThreadPoolExecutor(4) as pool:
        samples = [evidence for sample in pool.map(client_sample, range(4)) for evidence in sample]
    findings = recompute(path, samples)
    verdicts = [f.verdict for f in findings]
    assert Verdict.LIE in verdicts and Verdict.INVALID not in verdicts, findings
    assert {f.accused for f in findings if f.verdict == Verdict.LIE} == {peers["merged"]}
