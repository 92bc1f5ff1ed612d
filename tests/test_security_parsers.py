"""Every parser of a record read from the DHT, fuzzed over every field and type (issue 33, item 2).

A record is remote input even when its signature holds: its signer may be the attacker. Each parser must return a
valid, bounded record or None (or raise ValueError where the callers' contract says so), never anything else, and
what the health map prints of it must be valid JSON (no NaN, no Infinity, no bytes).
"""
from __future__ import annotations

import json
import math
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import MSGPackSerializer, get_dht_time
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.adapters.adapter import AdapterError
from swarm.adapters.sharing import PublishedAdapter
from swarm.dht.compatibility import CompatibilityTag
from swarm.dht.schema import (
    MAX_EXPERTS_PER_SERVER,
    MAX_NAME_CHARS,
    RECORD_VERSION,
    ExpertRecord,
    ServerRecord,
    ServerState,
    governance_key,
    parse_expert_entry,
)
from swarm.dht.validation import ed25519_text, sign_slot, slot_subkey
from swarm.governance.records import GovernanceState
from swarm.health.map import ExpertAnnouncement, build_health_map
from swarm.utils import fields

# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HUGE_TEXT = "x" * 1_000_000

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2**53, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.inf, -math.inf, math.nan, 1e308, -0.0]),
    st.text(max_size=50), st.binary(max_size=50), st.just(HUGE_TEXT), st.just("\ud800 lone surrogate"),
)
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                      st.dictionaries(st.one_of(st.text(max_size=5), st.integers()),
                                                                      inner, max_size=5)), max_leaves=12)


def strict_json(value: Any) -> str:
    """What the health map and the web map print: JSON without NaN or Infinity."""
    return json.dumps(value, allow_nan=False)


def mutated(base: dict, changes: dict) -> dict:
    """``base`` with some fields replaced by junk and some removed (a junk of None removes nothing)."""
    return {**base, **changes}


TAG = {"tokenizer": "byte-v1", "vocab_size": 260, "mask_token_id": 259}
SERVER = ServerRecord("peer", ServerState.ONLINE, 0, 2, 10.0, public_name="a", version="1", cache_tokens_left=5,
                      experts=["code"], extra={"k": 1}, addresses=["/ip4/1.2.3.4/tcp/1"], head=True,
                      adapter_kinds=["lora"], batch_invariant=True).to_value()
EXPERT = {"record_version": RECORD_VERSION, "domain": "code", "state": 2, "tag": TAG, "throughput": 1.0,
          "model": "m", "public_name": None, "version": "1"}


def field_changes(base: dict) -> st.SearchStrategy[dict]:
    return st.dictionaries(st.sampled_from(sorted(base)), junk, min_size=1, max_size=3)


# ----- server records -------------------------------------------------------------------------------------
def check_server(value: Any) -> None:
    record = ServerRecord.from_value("peer", value)
    if record is None:
        return
    assert 0 <= record.start < record.end and isinstance(record.start, int) and isinstance(record.end, int)
    assert math.isfinite(record.throughput) and 0 <= record.throughput
    assert isinstance(record.cache_tokens_left, int) and 0 <= record.cache_tokens_left <= fields.MAX_SAFE_INT
    assert record.public_name is None or len(record.public_name) <= MAX_NAME_CHARS
    assert len(record.version) <= 64 and len(record.experts) <= 32 and len(record.extra) <= 16
    # a claim of invariant passes only when the record says exactly true (clients then batch states through it)
    assert record.batch_invariant is (isinstance(value, dict) and value.get("batch_invariant") is True)
    health = build_health_map([record], "m", 4)
    strict_json(health.to_json())


@FUZZ
@given(field_changes(SERVER))
def test_server_record_fields(changes):
    check_server(mutated(SERVER, changes))


@FUZZ
@given(junk)
def test_server_record_whole_values(value):
    check_server(value)


def test_server_record_issue_values():
    """The values the issue measured: each made every new client raise or the health map print invalid JSON."""
    for change in ({"start": math.inf}, {"state": math.inf}, {"cache_tokens_left": math.inf},
                   {"end": 2**80}, {"version": HUGE_TEXT}, {"extra": {"x": HUGE_TEXT}}, {"public_name": b"x"}):
        record = ServerRecord.from_value("peer", mutated(SERVER, change))
        assert record is None or (len(record.version) <= 64 and all(len(str(v)) <= 256 for v in record.extra.values()))


# ----- expert records and the expert index -----------------------------------------------------------------
def check_expert(value: Any) -> None:
    record = ExpertRecord.from_value("peer", value)
    if record is not None:
        assert record.domain and len(record.domain) <= 64 and math.isfinite(record.throughput)
        strict_json(record.to_value())


@FUZZ
@given(field_changes(EXPERT))
def test_expert_record_fields(changes):
    check_expert(mutated(EXPERT, changes))


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(TAG)), junk, min_size=1, max_size=3))
def test_compatibility_tag_fields(changes):
    try:
        tag = CompatibilityTag.from_value(mutated(TAG, changes))
    except ValueError:
        return  # the contract: record parsers turn it into "not a record"
    assert isinstance(tag.vocab_size, int) and isinstance(tag.mask_token_id, int) and len(tag.tokenizer) <= 128
    check_expert(mutated(EXPERT, {"tag": mutated(TAG, changes)}))


@FUZZ
@given(st.lists(st.one_of(junk, field_changes(EXPERT).map(lambda c: mutated(EXPERT, c))), max_size=12), junk)
def test_expert_index_entries(items, whole):
    for value in ({"record_version": RECORD_VERSION, "experts": items}, whole):
        records = parse_expert_entry("peer", value)
        assert len(records) <= MAX_EXPERTS_PER_SERVER
        announcements = {r.domain: [ExpertAnnouncement(r.domain, "peer", r.to_value())] for r in records}
        strict_json(build_health_map([], "m", 1, announcements).to_json())


# ----- governance decisions ---------------------------------------------------------------------------------
GOVERNOR = Ed25519PrivateKey.generate()
DECISION = {"action": "halt", "reason": "r", "prefix": "m", "sequence": 1, "timestamp": 1.0}


def check_decision(body: Any) -> None:
    """A body signed by a trusted key (the worst case: a careless or compromised operator tool)."""
    try:
        payload = MSGPackSerializer.dumps(body)
    except Exception:  # msgpack cannot carry it (ints over 64 bits): nobody can store it either
        return
    if len(payload) > 16 * 1024:
        return  # over the slot's size bound: refused by every peer before any reader sees it
    expiration = get_dht_time() + 60
    value = sign_slot(GOVERNOR, governance_key("m"), payload, expiration)
    decision = GovernanceState("m", [GOVERNOR.public_key()]).consider(slot_subkey(GOVERNOR), value, expiration)
    if decision is not None:
        assert decision.action in ("halt", "resume") and len(decision.reason) <= 512
        assert math.isfinite(decision.timestamp) and 0 <= decision.sequence < 2**63


@FUZZ
@given(field_changes(DECISION))
def test_governance_decision_fields(changes):
    check_decision(mutated(DECISION, changes))


@FUZZ
@given(junk)
def test_governance_decision_whole_payloads(body):
    check_decision(body)


def test_governance_record_junk_values_never_raise():
    state = GovernanceState("m", [GOVERNOR.public_key()])
    for value in (None, 1, b"x", {"payload": 1, "signature": 2}, {"payload": b"x" * 100_000, "signature": b""}):
        for subkey in (slot_subkey(GOVERNOR), b"plain", 7, None):
            assert state.consider(subkey, value, get_dht_time() + 60) is None


# ----- published adapters ---------------------------------------------------------------------------------
ADAPTER = {"record_version": 1, "name": "a", "sha256": "0" * 64, "size": 10, "base": {"vocab_size": 260},
           "training": {"steps": 3, "lr_from": [[100, 0.5]]}, "score": 0.5, "served_by": ["peer"], "published": 1.0}


def check_adapter(body: Any) -> None:
    try:
        payload = MSGPackSerializer.dumps(body)
    except Exception:
        return
    try:
        record = PublishedAdapter.from_payload(payload, ed25519_text(GOVERNOR))
    except (ValueError, AdapterError):
        return  # the contract: read_published skips it
    assert record.size >= 1 and (record.score is None or math.isfinite(record.score))
    assert len(record.served_by) <= 16 and len(record.base) <= 16 and len(record.training) <= 32
    strict_json(record.to_json())


@FUZZ
@given(field_changes(ADAPTER))
def test_published_adapter_fields(changes):
    check_adapter(mutated(ADAPTER, changes))


@FUZZ
@given(junk)
def test_published_adapter_whole_payloads(body):
    check_adapter(body)


# ----- an expert's sparse answer (swarm.diffusion.sparse), as the client checks it -------------------------------
SPARSE_VOCAB = 40


def _honest_sparse(k: int = 6, seed: int = 0):
    import torch

    from swarm.diffusion.sparse import SparseScores

    generator = torch.Generator().manual_seed(seed)
    log_probs = torch.log_softmax(torch.randn(2, 3, SPARSE_VOCAB, generator=generator) * 3, dim=-1)
    return SparseScores.top_k(log_probs, k)


def _corrupt(kind: str):
    import torch

    from swarm.diffusion.sparse import SparseScores

    answer = _honest_sparse()
    ids, scores, rest = answer.ids.clone(), answer.log_probs.clone(), answer.rest.clone()
    if kind == "duplicate id":
        ids[..., 1] = ids[..., 0]
    elif kind == "id past the vocabulary":
        ids[..., -1] = SPARSE_VOCAB
    elif kind == "negative id":
        ids[..., 0] = -1
    elif kind == "unsorted ids":
        ids = ids.flip(-1)
    elif kind == "log-probability above 0":
        scores[..., 0] = 0.5
    elif kind == "NaN score":
        scores[..., 0] = float("nan")
    elif kind == "NaN rest":
        rest[..., 0] = float("nan")
    elif kind == "rest that does not fit":
        rest = torch.zeros_like(rest)
    elif kind == "more ids than asked":
        return answer, 5
    elif kind == "float ids":
        ids = ids.float()
    return SparseScores(ids, scores, rest, SPARSE_VOCAB), 6


SPARSE_LIES = ["duplicate id", "id past the vocabulary", "negative id", "unsorted ids", "log-probability above 0",
               "NaN score", "NaN rest", "rest that does not fit", "more ids than asked", "float ids"]


def test_an_honest_sparse_answer_passes():
    _honest_sparse().check((2, 3), 6)


@pytest.mark.parametrize("kind", SPARSE_LIES)
def test_each_lie_in_a_sparse_answer_is_refused(kind):
    answer, asked = _corrupt(kind)
    with pytest.raises(ValueError):
        answer.check((2, 3), asked)


# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 8), ids=st.lists(st.integers(-3, SPARSE_VOCAB + 3), min_size=8, max_size=8),
       scores=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=8, max_size=8),
       rest=st.floats(allow_nan=True, allow_infinity=True, width=32))
def test_any_sparse_answer_is_refused_or_gives_a_distribution(k, ids, scores, rest):
    """Whatever a server sends: ``check`` raises ValueError, or the answer fills in to a row of probabilities
    summing to 1 with no NaN."""
    import torch

    from swarm.diffusion.sparse import SparseScores

    answer = SparseScores(torch.tensor([ids[:k]]), torch.tensor([scores[:k]]), torch.tensor([rest]), SPARSE_VOCAB)
    try:
        answer.check((1,), k)
    except ValueError:
        return
    dense = answer.dense()
    assert not torch.isnan(dense).any()
    assert abs(float(dense.logsumexp(-1))) < 1e-2


@given(st.integers(1, SPARSE_VOCAB + 5), st.integers(0, 100))
def test_top_k_is_always_a_valid_answer_and_whole_at_the_vocabulary(k, seed):
    import torch

    from swarm.diffusion.sparse import SparseScores

    answer = _honest_sparse(k, seed)
    answer.check((2, 3), k)
    scores, ids = answer.wire_tensors()
    again = SparseScores.from_wire(scores, ids, SPARSE_VOCAB)
    assert torch.equal(again.ids, answer.ids) and torch.equal(again.log_probs, answer.log_probs)
    if k >= SPARSE_VOCAB:
        full = torch.log_softmax(torch.randn(2, 3, SPARSE_VOCAB, generator=torch.Generator().manual_seed(seed)) * 3,
                                 dim=-1)
        assert torch.equal(answer.dense(), full)


def test_sparse_wire_tensors_that_are_not_one_answer_are_refused():
    import torch

    from swarm.diffusion.sparse import SparseScores

    with pytest.raises(ValueError):
        SparseScores.from_wire(torch.zeros(2, 3, 7), torch.zeros(2, 3, 7, dtype=torch.int32), SPARSE_VOCAB)
    with pytest.raises(ValueError):
        SparseScores.from_wire(torch.zeros(2, 4, 7), torch.zeros(2, 3, 6, dtype=torch.int32), SPARSE_VOCAB)


# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(error=junk, code=junk, retry_after=junk)
def test_any_error_a_peer_answers_is_a_remote_error(error, code, retry_after):
    """A server's error metadata is remote input: whatever its code (a list or a map is unhashable), message and
    retry hint decode to, the client raises RemoteError, never another exception."""
    from swarm.wire.encoding import check_error
    from swarm.wire.messages import ErrorCode, RemoteError

    for value in (error, {"code": code, "message": error, "retry_after": retry_after}):
        try:
            check_error({"error": value})
        except RemoteError as raised:
            assert isinstance(raised.code, ErrorCode)
            assert raised.retry_after is None or 0 < raised.retry_after <= 3600


HEAD_QUERY = {"block_starts": [4], "block_length": 4, "steps": [0], "seed": 1, "temperature": 0.5, "cfg_scale": 0.0,
              "mask_token_id": 3, "scored": [4, 8]}


# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.dictionaries(st.sampled_from([*HEAD_QUERY, "top_k", "ahead"]), junk, max_size=4),
       whole=st.one_of(st.none(), junk), batch=st.integers(-2, 4), length=st.integers(-2, 16))
def test_any_head_query_is_parsed_or_refused(changes, whole, batch, length):
    """A head query is remote input to a head server: any field (``ahead`` and ``top_k`` included) set to anything
    gives a query within its bounds or a ValueError, never another exception."""
    from swarm.diffusion.config import MAX_EXPERT_TOP_K, MAX_STALENESS
    from swarm.diffusion.prediction import HeadQuery

    for value in (mutated(HEAD_QUERY, changes), whole):
        try:
            query = HeadQuery.parse(value, batch=batch, length=length, vocab_size=10)
        except ValueError:
            continue
        assert 0 <= query.ahead <= MAX_STALENESS and 0 <= query.top_k <= MAX_EXPERT_TOP_K
        assert not (query.ahead and query.top_k) and query.batch == batch
        assert query.output_shape[2] <= 4 * (1 + MAX_STALENESS) or query.output_shape[2] == 2 * query.top_k + 1


# ----- work stamps (swarm.dht.stamp, issue 55) -----------------------------------------------------------------------
ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=20),
                      st.binary(max_size=20), st.lists(st.integers(), max_size=3),
                      st.dictionaries(st.text(), st.none()))


# 300 examples: about one draw in 25 is an 8-byte stamp that meets its bits (2^-bits of them), the case a
# wrong check would refuse; 300 give about a dozen (docs/TESTING.md "Budgets")
@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=20, max_size=20), st.text(max_size=50), st.one_of(ANY_VALUE, st.binary(min_size=8,
                                                                                                   max_size=8)),
       st.integers(0, 12))
def test_a_stamp_from_the_network_is_checked_without_raising(key_id, signer, stamp, bits):
    """Any value where a stamp goes: never an exception; admitted exactly when it is 8 bytes whose sha256 (with the key
    and the signer) starts with ``bits`` zero bits (computed here from the definition), or no work is asked."""
    import hashlib

    from swarm.dht.stamp import stamp_refusal

    reason = stamp_refusal(key_id, signer, stamp, bits)
    assert reason is None or isinstance(reason, str)
    if bits == 0:
        assert reason is None
    elif not isinstance(stamp, bytes) or len(stamp) != 8:
        assert reason is not None
    else:
        digest = hashlib.sha256(b"swarm-stamp-v1" + len(key_id).to_bytes(2, "big") + key_id + signer.encode() + stamp)
        assert (reason is None) == (256 - int.from_bytes(digest.digest(), "big").bit_length() >= bits)


@settings(max_examples=30, deadline=None)
@given(st.binary(min_size=20, max_size=20), st.text(max_size=50), st.integers(1, 10))
def test_a_made_stamp_is_admitted_and_bound_to_its_key_and_signer(key_id, signer, bits):
    from swarm.dht.stamp import make_stamp, stamp_refusal

    stamp = make_stamp(key_id, signer, bits)
    assert stamp_refusal(key_id, signer, stamp, bits) is None
    assert make_stamp(key_id, signer, bits) == stamp  # made once, reused


def test_the_stamp_difficulty_setting_is_checked(monkeypatch):
    from swarm.dht.stamp import DEFAULT_STAMP_BITS, required_bits

    monkeypatch.setenv("SWARM_STAMP_BITS", "")
    assert required_bits() == DEFAULT_STAMP_BITS
    for bad in ("-1", "41", "ten", "1.5"):
        monkeypatch.setenv("SWARM_STAMP_BITS", bad)
        with pytest.raises(ValueError, match="SWARM_STAMP_BITS"):
            required_bits()
