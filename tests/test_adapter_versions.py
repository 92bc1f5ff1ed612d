"""Adapter versions (swarm.adapters.versions) and adoption by audit (swarm.reports.adoption), on the session's swarm.

Each attack of issue 49 is a test here: a version under another's name, a flood of versions, files that do not hash
to their version, scores from auditors the reader does not trust, a version overfitted to its public examples, a
version by a publisher the client does not trust.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from functools import partial  # picklable: run_coroutine ships it to the DHT process

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import MSGPackSerializer
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.adapters.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterError
from swarm.adapters.sharing import PublishedAdapter, content_hash, read_adapter_files, signed_value, store_slot
from swarm.adapters.versions import (
    MAX_VERSIONS,
    AdapterVersion,
    Reference,
    VersionList,
    publish_version,
    published_versions,
    read_versions,
    reference_of,
    resolve,
    versions_key,
)
from swarm.dht.schema import MAX_ADAPTER_VERSIONS_BYTES, now
from swarm.dht.validation import ed25519_text, sign_slot, slot_subkey
from swarm.governance.keys import generate_private_key
from swarm.improve.withdraw import withdraw_main
from swarm.reports.adoption import choose, to_score
from swarm.reports.records import AdapterAudit, AuditBook, AuditReport, publish_report
from tests.test_adapter_sharing import GENERATION, lying_host, make_adapter, peer  # noqa: F401 (fixtures)

DATA = hashlib.sha256(b"the examples").hexdigest()


@pytest.fixture(scope="module")
def host(lying_host):  # noqa: F811
    """This process's peer serving adapter files: ``serve(files, as_hash)`` (honest when as_hash is their hash);
    test_adapter_sharing's fixture, shared."""
    return lying_host


@pytest.fixture()
def cache(remote_lm, tmp_path, monkeypatch):
    monkeypatch.setattr(remote_lm, "adapter_cache", tmp_path / "cache")
    return tmp_path / "cache"


def served_version(dht, key, prefix, serve, lm, directory, name, seed, score=None, keep=MAX_VERSIONS):
    make_adapter(lm, directory, seed=seed)
    files = read_adapter_files(directory)
    serve(files, content_hash(files))
    return publish_version(dht, key, prefix, directory, name, DATA, score, keep=keep)


def test_versions_are_ordered_chosen_by_number_and_withdrawn(peer, host, remote_lm, local_lm, tmp_path,  # noqa: F811
                                                             cache, local_swarm):
    dht, _ = peer
    prefix, key = remote_lm.prefix, generate_private_key(tmp_path / "author.key")
    first, v1 = served_version(dht, key, prefix, host, local_lm, tmp_path / "v1", "versioned", 1, 0.25)
    second, v2 = served_version(dht, key, prefix, host, local_lm, tmp_path / "v2", "versioned", 2, 0.5)
    assert (v1.number, v1.parent, v2.number, v2.parent) == (1, None, 2, v1.sha256)
    assert v2.data == DATA and second.sha256 == v2.sha256, "the name record follows the newest version"
    (listed,) = read_versions(dht, prefix, "versioned")
    assert [v.sha256 for v in listed.versions] == [v1.sha256, v2.sha256] and listed.author == ed25519_text(key)
    with pytest.raises(AdapterError, match="already lists this content as version 2"):
        publish_version(dht, key, prefix, tmp_path / "v2", "versioned", DATA)

    by_version = {n: remote_lm.generate("adapt", adapter=f"versioned@{n}", **GENERATION).token_ids for n in (1, 2)}
    assert by_version[1] == local_lm.generate("adapt", adapter=str(tmp_path / "v1"), **GENERATION).token_ids
    assert by_version[2] == local_lm.generate("adapt", adapter=str(tmp_path / "v2"), **GENERATION).token_ids
    assert by_version[1] != by_version[2]
    author = second.author_id
    assert resolve(dht, prefix, "versioned").sha256 == v2.sha256
    assert resolve(dht, prefix, f"versioned@{author}@1").sha256 == v1.sha256

    peers = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
    done = CliRunner().invoke(withdraw_main, ["--name", "versioned", "--version", "2", "--key",
                                              str(tmp_path / "author.key"), "--dht-prefix", prefix, *peers])
    assert done.exit_code == 0, done.output
    assert [v["withdrawn"] for v in json.loads(done.stdout)] == [False, True]
    with pytest.raises(AdapterError, match="version 2 was withdrawn by its publisher"):
        resolve(dht, prefix, "versioned@2")
    assert resolve(dht, prefix, "versioned").sha256 == v1.sha256, "the name went back to the newest version left"
    assert [r.sha256 for r in published_versions(dht, prefix, 64) if r.name == "versioned"] == [v1.sha256]
    with pytest.raises(AdapterError, match="no version 7"):
        resolve(dht, prefix, "versioned@7")


# ----- attacks -------------------------------------------------------------------------------------------
def test_a_trainer_cannot_publish_a_version_under_anothers_name(peer, host, remote_lm, local_lm,  # noqa: F811
                                                                 tmp_path):
    dht, _ = peer
    prefix = remote_lm.prefix
    author, impostor = (generate_private_key(tmp_path / n) for n in ("author.key", "impostor.key"))
    record, genuine = served_version(dht, author, prefix, host, local_lm, tmp_path / "a", "owned-name", 3)
    # The impostor signs a version list into the author's slot (a later expiration): refused, never read.
    forged = VersionList("owned-name", (genuine, AdapterVersion(2, "e" * 64, 10, genuine.sha256, DATA, 1.0)))
    expiration = now() + 30 * 24 * 3600
    value = sign_slot(impostor, versions_key(prefix, "owned-name"), forged.payload(), expiration)
    assert not dht.store(versions_key(prefix, "owned-name"), value, expiration_time=expiration,
                         subkey=slot_subkey(author))
    # A list the author signed for another name cannot be moved under this one (the signature covers the key).
    elsewhere = sign_slot(author, versions_key(prefix, "other-name"), forged.payload(), expiration)
    assert not dht.store(versions_key(prefix, "owned-name"), elsewhere, expiration_time=expiration,
                         subkey=slot_subkey(author))
    lists = read_versions(dht, prefix, "owned-name")
    assert [v.sha256 for v in lists[0].versions] == [genuine.sha256] and len(lists) == 1
    # Its own versions under the same name are its own: the author's reference still names the author's content.
    served_version(dht, impostor, prefix, host, local_lm, tmp_path / "b", "owned-name", 4)
    assert resolve(dht, prefix, f"owned-name@{record.author_id}@1").sha256 == genuine.sha256
    with pytest.raises(AdapterError, match="several authors published 'owned-name'"):
        resolve(dht, prefix, "owned-name@1")


def test_a_flood_of_versions_is_bounded(peer, host, remote_lm, local_lm, tmp_path):  # noqa: F811
    dht, _ = peer
    prefix, key = remote_lm.prefix, generate_private_key(tmp_path / "flood.key")
    for seed in range(5):
        served_version(dht, key, prefix, host, local_lm, tmp_path / f"f{seed}", "flooded", 10 + seed, keep=3)
    (listed,) = read_versions(dht, prefix, "flooded")
    assert [v.number for v in listed.versions] == [3, 4, 5], "publishing keeps the newest versions only"
    many = tuple(AdapterVersion(n, hashlib.sha256(bytes([n])).hexdigest(), 10, None, DATA) for n in range(1, 18))
    with pytest.raises(ValueError, match=f"at most {MAX_VERSIONS} versions"):
        VersionList("flooded", many).payload()
    # Signed by the author itself, an over-long list is stored (the slot is its own) but no reader takes it.
    raw = MSGPackSerializer.dumps({"record_version": 1, "name": "flooded", "versions": [v.to_value() for v in many]})
    assert len(raw) < MAX_ADAPTER_VERSIONS_BYTES
    store_slot(dht, key, versions_key(prefix, "flooded"), raw, now() + 8 * 24 * 3600)
    assert read_versions(dht, prefix, "flooded") == []
    with pytest.raises(ValueError, match="at most"):
        VersionList.from_payload(b"\0" * (MAX_ADAPTER_VERSIONS_BYTES + 1), "x")


def test_a_version_whose_files_do_not_hash_to_its_record_is_refused(peer, host, remote_lm, local_lm,  # noqa: F811
                                                                    tmp_path, cache):
    dht, _ = peer
    prefix, key = remote_lm.prefix, generate_private_key(tmp_path / "k.key")
    served_version(dht, key, prefix, host, local_lm, tmp_path / "good", "tampered-version", 5)
    make_adapter(local_lm, tmp_path / "bad", seed=6)
    record, version = publish_version(dht, key, prefix, tmp_path / "bad", "tampered-version", DATA)
    files = read_adapter_files(tmp_path / "good")  # a host answers version 2's hash with version 1's files
    host({ADAPTER_CONFIG: files[ADAPTER_CONFIG], ADAPTER_WEIGHTS: files[ADAPTER_WEIGHTS]}, version.sha256)
    with pytest.raises(AdapterError, match="sha256 differs from the published one|bytes for adapter"):
        remote_lm.load_adapter("tampered-version@2")
    assert not (cache / version.sha256).exists()


# ----- adoption by audit ------------------------------------------------------------------------------------
def scored(record, auditor_key, correct, examples=40, checked=None):
    return AdapterAudit(record.name, record.author, record.sha256, "addition", examples, correct,
                        checked or time.time(), record.score)


def report(prefix, auditor_key, scores, sequence):
    return AuditReport(prefix, sequence, time.time(), (), ed25519_text(auditor_key), tuple(scores))


def test_adoption_reads_trusted_auditors_only_and_moves_by_the_margin(peer, host, remote_lm, local_lm,  # noqa: F811
                                                                      tmp_path):
    dht, _ = peer
    prefix = remote_lm.prefix
    trainer, stranger = generate_private_key(tmp_path / "t.key"), generate_private_key(tmp_path / "s.key")
    trusted, untrusted = generate_private_key(tmp_path / "a.key"), generate_private_key(tmp_path / "b.key")
    good = served_version(dht, trainer, prefix, host, local_lm, tmp_path / "g", "improving", 20, 0.4)[0]
    # The overfitted version: its trainer's figure (on the examples it trained on) is perfect, fresh problems say not.
    overfit = served_version(dht, trainer, prefix, host, local_lm, tmp_path / "o", "improving", 21, 1.0)[0]
    # A stranger's version, measured best of all.
    strange = served_version(dht, stranger, prefix, host, local_lm, tmp_path / "x", "improving", 22, 0.9)[0]
    published = [r for r in published_versions(dht, prefix, 64) if r.name == "improving"]
    assert {reference_of(r) for r in published} >= {reference_of(good), reference_of(overfit)}

    assert publish_report(dht, trusted, report(prefix, trusted, [scored(good, trusted, 16), scored(overfit, trusted, 4),
                                                                 scored(strange, trusted, 30)], 1), 600)
    # An auditor the client does not trust says the overfitted version is perfect: never read.
    assert publish_report(dht, untrusted, report(prefix, untrusted, [scored(overfit, untrusted, 40)], 1), 600)
    book = AuditBook(prefix, frozenset({ed25519_text(trusted)}))
    book.refresh(dht)
    assert set(book.reports) == {ed25519_text(trusted)}

    publishers = frozenset({good.author_id})
    chosen = choose(book, "addition", published, publishers=publishers)
    assert chosen.record.sha256 == good.sha256, "the overfitted version (and the stranger's) did not win"
    assert choose(book, "addition", published).record.sha256 == strange.sha256, "trusting any publisher, it wins"

    # Holding `good`, a version measured better by less than the margin does not move the choice; by more, it does.
    close = [scored(good, trusted, 16), scored(overfit, trusted, 17, checked=time.time() + 1)]
    book.consider(report(prefix, trusted, close, 2))
    assert choose(book, "addition", published, good.sha256, 0.05, publishers).replaced is None
    better = [scored(good, trusted, 16), scored(overfit, trusted, 24, checked=time.time() + 2)]
    book.consider(report(prefix, trusted, better, 3))
    moved = choose(book, "addition", published, good.sha256, 0.05, publishers)
    assert moved.record.sha256 == overfit.sha256 and moved.replaced == good.sha256
    # A later audit finds it worse: the choice moves back.
    worse = [scored(good, trusted, 17, checked=time.time() + 3), scored(overfit, trusted, 5, checked=time.time() + 3)]
    book.consider(report(prefix, trusted, worse, 4))
    assert choose(book, "addition", published, overfit.sha256, 0.05, publishers).record.sha256 == good.sha256

    # The auditor scores new versions first, then the ones scored longest ago.
    order = to_score(published, {(good.sha256, "addition"): scored(good, trusted, 1, checked=5.0)}, 16)
    assert order[-1].sha256 == good.sha256 and len(order) == len({r.sha256 for r in published})


def test_a_version_audited_right_on_no_problem_of_a_task_is_never_adopted_for_it():
    """``best:TASK`` over versions the auditor scored on every stream's task (the streams demonstration): a version of
    another task's stream, or one that broke the model, audited 0/40 on TASK is adopted neither where nothing else
    was scored (nothing, the base model, is better) nor when it is the held choice; one right answer makes it a
    candidate, and the best score on the task still wins, whichever stream published it."""
    auditor = Ed25519PrivateKey.generate()
    author = ed25519_text(Ed25519PrivateKey.generate())
    tagged, bracketed = (PublishedAdapter(name, sha * 64, 10, {}, author=author) for name, sha in
                         (("tagged", "a"), ("bracketed", "b")))
    book = AuditBook("p", frozenset({ed25519_text(auditor)}))

    def audit(sequence: int, *entries: tuple[PublishedAdapter, str, int]) -> None:
        scores = [dataclasses.replace(scored(record, auditor, correct), task=task) for record, task, correct in entries]
        assert book.consider(report("p", auditor, scores, sequence))

    audit(1, (tagged, "tagged-addition", 30), (tagged, "bracketed-addition", 0))
    assert choose(book, "tagged-addition", [tagged]).record is tagged
    assert choose(book, "bracketed-addition", [tagged]) is None, "a version audited 0.00 won over nothing"
    assert choose(book, "bracketed-addition", [tagged], held=tagged.sha256) is None, "held, it stayed"
    audit(2, (tagged, "bracketed-addition", 0), (bracketed, "bracketed-addition", 1))
    assert choose(book, "bracketed-addition", [tagged, bracketed]).record is bracketed
    audit(3, (tagged, "bracketed-addition", 5), (bracketed, "bracketed-addition", 1))
    assert choose(book, "bracketed-addition", [tagged, bracketed]).record is tagged, "the best score, any stream's"


def test_a_report_lists_the_scores_that_found_a_version_right_before_the_zeros_of_later_ones():
    """An auditor scoring three stream tasks makes more scores a round than a report holds; the zeros (versions on
    other streams' tasks), made later in the round, took the places of the new versions' scores."""
    from swarm.audit.auditor import reported_scores

    auditor, author = Ed25519PrivateKey.generate(), ed25519_text(Ed25519PrivateKey.generate())
    records = [PublishedAdapter(f"v{i}", f"{i:064x}", 10, {}, author=author) for i in range(12)]
    right = [scored(record, auditor, 20, checked=100.0 + i) for i, record in enumerate(records[:4])]
    zeros = [dataclasses.replace(scored(record, auditor, 0, checked=200.0 + i), task="host-blocks")
             for i, record in enumerate(records)]
    listed = reported_scores(zeros + right, 8)
    assert len(listed) == 8 and set(right) <= set(listed), "a score that found a version right went unlisted"
    assert {a.checked for a in listed if a.correct == 0} == {208.0, 209.0, 210.0, 211.0}, "then the latest"
    assert list(listed) == sorted(listed, key=lambda a: (a.name, a.task, a.sha256))


# ----- parsers of remote input ---------------------------------------------------------------------------
LEAVES = (st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats() | st.text(max_size=70)
          | st.sampled_from(["a" * 64, DATA]))
ENTRY = st.lists(LEAVES, min_size=8, max_size=8)
LISTS = st.fixed_dictionaries({"record_version": st.just(1), "name": st.sampled_from(["n", "x y", 5]),
                               "versions": st.lists(ENTRY, max_size=18)})


# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=600) | st.builds(MSGPackSerializer.dumps, LISTS | st.recursive(
    LEAVES, lambda inner: st.lists(inner, max_size=9) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=40)))
def test_version_lists_parse_or_fail_cleanly(payload):
    try:
        listed = VersionList.from_payload(payload, "x")
    except ValueError:
        return
    assert len(listed.versions) <= MAX_VERSIONS and len(listed.payload()) <= MAX_ADAPTER_VERSIONS_BYTES


# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None)
@given(st.text(max_size=100))
def test_references_parse_or_fail_cleanly(text):
    try:
        parsed = Reference.parse(text)
    except AdapterError:
        return
    assert str(parsed) == text


# ----- issue 55: shared lists read fairly, own keys nobody else fills, withdrawals that follow the content --------
# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=3), st.lists(st.text(max_size=4), max_size=70, unique=True),
                       max_size=40),
       st.integers(0, 80), st.lists(st.text(min_size=1, max_size=3), max_size=4), st.randoms(use_true_random=False))
def test_a_fair_sample_reads_trusted_writers_first_and_no_writer_ahead_of_another(groups, limit, trusted, rng):
    """Whatever the writers list (any count, any order, items shared between writers): at most ``limit`` items, each
    once; every item of the trusted writers first; then round robin: a writer with items left out is never more than
    one item behind another, counting the items of its own that others took (one writer listing many names that sort
    first cannot crowd the others out, issue 55, 3)."""
    from swarm.dht.sample import fair_sample

    chosen = fair_sample(groups, limit, trusted, rng)
    items = [item for _, item in chosen]
    assert len(chosen) <= limit and len(items) == len(set(items))
    assert all(item in groups[writer] for writer, item in chosen)
    trusted_items = list(dict.fromkeys(i for w in dict.fromkeys(trusted) if w in groups for i in groups[w]))
    assert items[:len(trusted_items)] == trusted_items[:limit]
    if len(chosen) < limit:
        assert set(items) == {i for listed in groups.values() for i in listed}, "an item was left out below the limit"
    taken = {writer: [i for w, i in chosen if w == writer] for writer in groups}
    for behind in (w for w in groups if w not in trusted and set(groups[w]) - set(items)):
        by_others = len([i for i in groups[behind] if i in items and i not in taken[behind]])
        for ahead in (w for w in groups if w not in trusted):
            assert len(taken[behind]) + by_others >= len(taken[ahead]) - 1, (behind, ahead, chosen)


def test_a_withdrawal_counts_for_every_publisher_of_the_content_by_the_readers_trust():
    """Whose withdrawal counts: the record's own publisher's and trusted publishers' for a reader that trusts some;
    anybody's for one that trusts none (issue 55, 4)."""
    from swarm.adapters.sharing import author_id
    from swarm.adapters.versions import is_withdrawn, withdrawals

    keys = [ed25519_text(Ed25519PrivateKey.generate()) for _ in range(3)]
    honest, stranger, other = keys
    sha = "c" * 64
    withdrawn_by_honest = withdrawals([VersionList("n", (AdapterVersion(1, sha, 10, None, DATA, withdrawn=True),),
                                                   honest)])
    republished = PublishedAdapter("n", sha, 10, {}, author=stranger)
    assert is_withdrawn(republished, withdrawn_by_honest), "a stranger's republication brought it back"
    assert is_withdrawn(republished, withdrawn_by_honest, frozenset({author_id(honest)}))
    assert not is_withdrawn(republished, withdrawn_by_honest, frozenset({author_id(stranger)}))
    withdrawn_by_stranger = withdrawals([VersionList("m", (AdapterVersion(3, sha, 10, None, DATA, withdrawn=True),),
                                                     stranger)])
    own = PublishedAdapter("n", sha, 10, {}, author=honest)
    assert not is_withdrawn(own, withdrawn_by_stranger, frozenset({author_id(other)})), \
        "a stranger's withdrawal hid content from a reader trusting others"
    assert is_withdrawn(own, withdrawn_by_stranger)


def fresh_prefix(label: str) -> str:
    """A prefix of its own for a test that floods shared lists (the session's prefix stays readable for the others)."""
    return f"{label}-{time.monotonic_ns() % 10**9}"


async def _store_slots(_dht, node, key: str, values: list, subkeys: list, expiration: float) -> dict:
    return await node.store_many([key] * len(values), values, expiration, subkeys=subkeys)


def fresh_slots(dht, key: str, payload: bytes, count: int, expiration: float) -> int:
    """Store ``count`` slots of fresh keys under ``key`` (each value naming ``key``, with the work stamp the shared
    keys ask) in one batch, as a flooder would: one search for the key's peers and one call to each, where a store a
    slot cost both (the flood was most of its test's CPU); how many a storing peer took."""
    keys = [Ed25519PrivateKey.generate() for _ in range(count)]
    subkeys = [slot_subkey(fresh) for fresh in keys]
    values = [signed_value(fresh, key, payload, expiration) for fresh in keys]
    stored = dht.run_coroutine(partial(_store_slots, key=key, values=values, subkeys=subkeys, expiration=expiration))
    return sum(bool(stored.get((key, subkey))) for subkey in subkeys)


def stranger_slots(dht, key: str, payload: bytes, count: int) -> int:
    """How many stores of fresh keys' slots (each value naming ``key``) the swarm took under ``key``: ``count`` at
    once, then fresh keys one by one until one was refused by every storing peer (at most ``3 * count`` in all).
    The bound is per storing peer, and a store that any of them took counts as taken: on a loaded machine one can
    miss a peer, whose hole a later slot then fills (a flood left short of the bound anywhere is no attack)."""
    expiration = now() + 3600
    taken = fresh_slots(dht, key, payload, count, expiration)
    for _ in range(2 * count):
        stored = fresh_slots(dht, key, payload, 1, expiration)
        if not stored and taken >= count:
            break
        taken += stored
    return taken


def test_fresh_keys_filling_the_shared_index_and_name_keys_do_not_hide_a_version(peer, host, remote_lm,  # noqa: F811
                                                                                   local_lm, tmp_path, monkeypatch,
                                                                                   caplog):
    """Issue 55, 2: 32 slots of fresh keys under the served prefix's adapter index (and the name's shared keys) made a
    trainer's version publish report v1 while its name was in neither the index nor the catalog. Its name record,
    index entry and versions now live under its own keys: the publish is read back from them (in one read, which also
    tells it to warn that the shared list is full), a reader trusting the trainer finds it in the catalog and
    ``best:``'s candidates, and ``NAME@AUTHOR@1`` resolves."""
    from swarm.adapters import sharing
    from swarm.adapters.sharing import author_id, catalog_names, index_key, name_key

    dht, _ = peer
    prefix, key, name = fresh_prefix("crowded"), Ed25519PrivateKey.generate(), "crowded"
    listing = MSGPackSerializer.dumps([f"squat-{i}" for i in range(64)])
    assert stranger_slots(dht, index_key(prefix), listing, 32) >= 32, "the flood did not fill the shared index"
    stranger_slots(dht, name_key(prefix, name), b"squat", 24)
    stranger_slots(dht, versions_key(prefix, name), b"squat", 32)
    reads: list[list[str]] = []
    read_entries = sharing.read_entries
    monkeypatch.setattr(sharing, "read_entries", lambda dht, keys: reads.append(list(keys)) or read_entries(dht, keys))
    with caplog.at_level("WARNING", logger="swarm.adapters.sharing"):
        record, version = served_version(dht, key, prefix, host, local_lm, tmp_path / "v1", name, 21)
    assert "the shared list of its authors is full" in caplog.text
    assert sum(name_key(prefix, name) in keys for keys in reads) == 1, "the publish read its name keys back twice"
    author = author_id(ed25519_text(key))
    # The premise, the shared index full where the publish stored, is the warning above (its read-back did not list
    # the trainer). A later read by a reader trusting nobody was also required not to list it; in two .ci/runs of
    # 2026-12-06 (load 5-9) it did, after the publish had warned. Likely cause, not proven: hivemind's store goes on to
    # farther peers while the nearest refuse, and a reader's search can meet the entry there. What a trusting reader
    # finds (below) comes from the author's own keys either way.
    assert (name, author) in {(n, author_id(a)) for a, n in catalog_names(dht, prefix, 64, [author])}
    assert version.sha256 in {r.sha256 for r in published_versions(dht, prefix, 64, frozenset({author}))}
    assert resolve(dht, prefix, f"{name}@{author}@1").sha256 == version.sha256


def test_an_index_entry_of_names_that_sort_first_does_not_empty_the_catalog(peer, host, remote_lm, local_lm,  # noqa: F811
                                                                          tmp_path):
    """Issue 55, 3: the catalog read ``sorted(names)[:64]``, so one author listing 64 names that sort first emptied it
    for every reader (the auditor scored nothing, ``best:`` adopted nothing). Readers take a fair sample over authors:
    a trainer's new version is read even by a reader that trusts nobody."""
    from swarm.adapters.sharing import index_key

    dht, _ = peer
    prefix, key = fresh_prefix("sorted"), Ed25519PrivateKey.generate()
    expiration, squatter = now() + 3600, Ed25519PrivateKey.generate()
    names = MSGPackSerializer.dumps([f"0000-{i:02d}" for i in range(64)])
    assert dht.store(index_key(prefix), signed_value(squatter, index_key(prefix), names, expiration),
                     expiration_time=expiration, subkey=slot_subkey(squatter))
    _, version = served_version(dht, key, prefix, host, local_lm, tmp_path / "v1", "zz-sorts-last", 22)
    # A catalog of 8 names: the squatter's 64 fill it as they fill the auditor's 64, and each name read costs DHT
    # reads (64 names three times was most of this test's CPU).
    for _ in range(3):  # the sample is random: every draw holds the trainer's version
        assert version.sha256 in {r.sha256 for r in published_versions(dht, prefix, 8)}


def test_republished_withdrawn_content_stays_withdrawn_under_every_name(peer, host, remote_lm, local_lm,  # noqa: F811
                                                                        tmp_path):
    """Issue 55, 4: a withdrawal marked only its publisher's list, so a stranger republishing the withdrawn content
    under the same name brought it back for every client that trusts no publisher. The content is withdrawn: under the
    name (resolve, the catalog, the auditor's scoring and ``best:``'s candidates) and under another name read with
    it."""
    from swarm.adapters.sharing import author_id
    from swarm.adapters.versions import withdraw_version

    dht, _ = peer
    prefix, name = fresh_prefix("recalled"), "recalled"
    publisher, stranger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    served_version(dht, publisher, prefix, host, local_lm, tmp_path / "v1", name, 31)
    _, bad = served_version(dht, publisher, prefix, host, local_lm, tmp_path / "v2", name, 32)
    withdraw_version(dht, publisher, prefix, name, 2)
    again, copy = served_version(dht, stranger, prefix, host, local_lm, tmp_path / "copy", name, 32)
    _, elsewhere = served_version(dht, stranger, prefix, host, local_lm, tmp_path / "copy2", f"{name}-b", 32)
    assert copy.sha256 == bad.sha256 == elsewhere.sha256, "the stranger did not republish the same content"
    with pytest.raises(AdapterError, match="withdrew"):
        resolve(dht, prefix, f"{name}@{again.author_id}@1")
    published = [r for r in published_versions(dht, prefix, 64) if r.name.startswith(name)]
    assert published and bad.sha256 not in {r.sha256 for r in published}
    # The list before the withdrawal, stored again under the shared key (a copy an older peer kept): the publisher's
    # own key, read first, still says withdrawn.
    (before,) = [listed for listed in read_versions(dht, prefix, name) if listed.author == ed25519_text(publisher)]
    stale = VersionList(name, tuple(dataclasses.replace(v, withdrawn=False) for v in before.versions))
    assert store_slot(dht, publisher, versions_key(prefix, name), stale.payload(), now() + 30.5 * 24 * 3600)
    with pytest.raises(AdapterError, match="withdrawn by its publisher"):
        resolve(dht, prefix, f"{name}@{author_id(ed25519_text(publisher))}@2")
