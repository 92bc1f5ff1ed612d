"""Parsers of remote input in swarm.weights, fuzzed: manifests, read requests, name and hosts records.

Each must return a valid, bounded value or raise its one documented error type (ManifestError, RemoteError,
ValueError), whatever arrives; and the rules they enforce are checked one by one on a real manifest.
"""
from __future__ import annotations

import json
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import MSGPackSerializer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from swarm.adapters.sharing import author_id
from swarm.dht.validation import ed25519_text
from swarm.weights.cache import PartialTensor, tensor_indices
from swarm.weights.manifest import (
    MAX_PART_BYTES,
    MIN_PART_BYTES,
    SMALL_FILES,
    Manifest,
    ManifestError,
    build_manifest,
    check_against_config,
    part_bytes_for,
)
from swarm.weights.records import HostRecord, PublishedModel, WeightsError, choose_published, parse_reference
from swarm.weights.trust import PublisherTrust, TrustError
from swarm.weights.wire import MAX_READ_BYTES, ReadRequest
from swarm.wire.messages import ErrorCode, RemoteError

# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])
MODEL_ID = "ab" * 32

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63), st.integers(2**60, 2**64 - 1),
                    st.floats(), st.text(max_size=40), st.binary(max_size=40))  # integers: what msgpack encodes
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                      max_leaves=12)
json_values = st.recursive(  # what a JSON manifest can hold
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=40)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12)


@pytest.fixture(scope="module")
def manifest(tiny_model_path) -> Manifest:
    return build_manifest(tiny_model_path)


def changed(manifest: Manifest, path: tuple, value: Any) -> bytes:
    """The manifest's canonical bytes with the field at ``path`` set to ``value``."""
    data = json.loads(manifest.to_bytes())
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


# ----- manifests -------------------------------------------------------------------------------------------------
def test_a_manifest_round_trips_and_names_itself(manifest, tiny_model_path):
    data = manifest.to_bytes()
    assert Manifest.from_bytes(data, manifest.model_id) == manifest
    assert build_manifest(tiny_model_path).model_id == manifest.model_id  # deterministic: servers agree on the id
    check_against_config(manifest, tiny_model_path)
    with pytest.raises(ManifestError, match="do not hash to the model id"):
        Manifest.from_bytes(data, MODEL_ID)
    with pytest.raises(ManifestError, match="canonical"):
        Manifest.from_bytes(json.dumps(json.loads(data), indent=1).encode())


@pytest.mark.parametrize("path, value, message", [
    (("files", 0, "name"), "../../etc/passwd", "not one of the files a model may list"),
    (("tensors", 0, "name"), "../x", "tensor name"),
    (("tensors", 0, "file"), "/etc/passwd", "file name"),
    (("name",), "..", "model name"),
    (("tensors", 0, "dtype"), "I64", "dtype"),
    (("tensors", 0, "size"), 12, "is not its shape"),
    (("tensors", 0, "shape"), [2**40, 2**40], "is not its shape"),
    (("tensors", 0, "part_bytes"), 1, "part_bytes"),
    (("tensors", 0, "part_bytes"), MAX_PART_BYTES * 2, "part_bytes"),
    (("tensors", 0, "parts"), [], "part hashes"),
    (("tensors", 0, "sha256"), "AB" * 32, "sha256"),
    (("manifest_version",), 2, "unknown manifest version"),
    (("extra",), 1, "unexpected fields"),
    (("files",), [], "include config.json"),
])
def test_each_manifest_rule_is_enforced(manifest, path, value, message):
    with pytest.raises(ManifestError, match=message):
        Manifest.from_bytes(changed(manifest, path, value))


def test_a_manifest_with_a_tensor_twice_or_over_the_size_bound_is_refused(manifest):
    data = json.loads(manifest.to_bytes())
    data["tensors"].append(data["tensors"][0])
    with pytest.raises(ManifestError, match="listed twice"):
        Manifest.from_bytes(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())
    with pytest.raises(ManifestError, match="over the limit"):
        Manifest.from_bytes(b" " * (17 * 2**20))


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_are_a_manifest_or_a_manifest_error(data):
    try:
        Manifest.from_bytes(data)
    except ManifestError:
        pass


@FUZZ
@given(path=st.sampled_from([("name",), ("files", 0), ("files", 0, "size"), ("tensors",), ("tensors", 0),
                             ("tensors", 0, "shape"), ("tensors", 0, "offset"), ("tensors", 0, "parts"),
                             ("tensors", 0, "parts", 0), ("tensors", 1, "dtype")]), value=json_values)
def test_any_field_of_a_manifest_is_checked(manifest, path, value):
    try:
        parsed = Manifest.from_bytes(changed(manifest, path, value))
    except ManifestError:
        return
    assert all(f.name in SMALL_FILES for f in parsed.files)
    assert all(MIN_PART_BYTES <= t.part_bytes <= MAX_PART_BYTES for t in parsed.tensors)


def test_a_manifest_whose_tensors_are_not_its_configs_is_refused(manifest, tiny_model_path, tmp_path):
    for name in ("config.json",):
        (tmp_path / name).write_bytes((tiny_model_path / name).read_bytes())
    missing = Manifest(manifest.name, manifest.files, manifest.tensors[1:])
    with pytest.raises(ManifestError, match="disagrees with its config: .* is missing"):
        check_against_config(missing, tmp_path)


def test_part_sizes_are_a_power_of_two_within_the_bounds():
    assert part_bytes_for(0) == part_bytes_for(100) == MIN_PART_BYTES
    assert part_bytes_for(8192) == 2048
    assert part_bytes_for(16 * 2**30) == MAX_PART_BYTES


# ----- the cache's own names ---------------------------------------------------------------------------------------
def test_only_the_caches_own_tensor_names_are_files():
    assert tensor_indices(["t-00003.safetensors"], 4) == [3]
    for name in ("t-00004.safetensors", "../t-00001.safetensors", "model.safetensors", "t-1.safetensors"):
        with pytest.raises(FileNotFoundError):
            tensor_indices([name], 4)


def test_a_partial_tensor_refuses_a_part_of_the_wrong_length(manifest, tmp_path):
    entry = next(t for t in manifest.tensors if len(t.parts) > 1)
    partial = PartialTensor(tmp_path / "t-00000.safetensors", entry)
    with pytest.raises(ValueError, match="bytes"):
        partial.write(0, b"\0")
    partial.close()


# ----- read requests ---------------------------------------------------------------------------------------------
def request(**changes) -> bytes:
    base = {"model": MODEL_ID, "kind": "tensor", "name": 3, "offset": 0, "length": 100}
    return MSGPackSerializer.dumps(dict(base, **changes))


def test_read_requests_are_checked():
    assert ReadRequest.parse(request()) == ReadRequest(MODEL_ID, "tensor", 3, 0, 100)
    assert ReadRequest.parse(request(kind="file", name="config.json")).name == "config.json"
    for bad in (dict(model="x"), dict(kind="path"), dict(kind="file", name="../../etc/passwd"), dict(name=-1),
                dict(name=True), dict(offset=-1), dict(length=1.5), dict(kind="manifest", name="x")):
        with pytest.raises(RemoteError) as refused:
            ReadRequest.parse(request(**bad))
        assert refused.value.code == ErrorCode.BAD_REQUEST, bad
    with pytest.raises(RemoteError, match="over"):
        ReadRequest.parse(request(length=MAX_READ_BYTES + 1))


@FUZZ
@given(st.dictionaries(st.sampled_from(["model", "kind", "name", "offset", "length", "x"]), values, max_size=6))
def test_any_read_request_is_valid_or_refused(metadata):
    try:
        parsed = ReadRequest.parse(MSGPackSerializer.dumps(metadata))
    except RemoteError:
        return
    assert 0 <= parsed.length <= MAX_READ_BYTES and parsed.offset >= 0


@FUZZ
@given(st.binary(max_size=200))
def test_any_bytes_are_a_read_request_or_refused(raw):
    try:
        ReadRequest.parse(raw)
    except RemoteError:
        pass


# ----- records ---------------------------------------------------------------------------------------------------
@FUZZ
@given(st.dictionaries(st.sampled_from(["record_version", "addresses", "manifest_bytes", "tensors", "x"]), values,
                       max_size=5))
def test_any_hosts_record_is_valid_or_a_value_error(value):
    try:
        record = HostRecord.from_value("peer", dict(value, record_version=1))
    except ValueError:
        return
    assert record.manifest_bytes >= 1 and (record.tensors is None or all(i >= 0 for i in record.tensors))


def test_a_hosts_record_round_trips_its_bitmap():
    record = HostRecord("peer", ("/ip4/127.0.0.1/tcp/1",), 10, frozenset({0, 5, 17}))
    assert HostRecord.from_value("peer", record.to_value()) == record
    assert HostRecord.from_value("peer", HostRecord("peer", (), 10).to_value()).tensors is None


@FUZZ
@given(st.dictionaries(st.sampled_from(["record_version", "name", "model_id", "manifest_bytes", "weights_bytes",
                                        "published"]), values, max_size=6))
def test_any_name_record_is_valid_or_a_value_error(value):
    try:
        PublishedModel.from_payload(MSGPackSerializer.dumps(dict(value, record_version=1)), "key")
    except ValueError:
        pass


@pytest.mark.parametrize("reference", ["a/b", "name@XYZ", "name@0123", "", "-x", "x" * 65])
def test_a_malformed_reference_is_refused(reference):
    with pytest.raises(ValueError, match="no published model name"):
        parse_reference(reference)


# ----- issue 48: names resolve only through trusted publishers, whatever records arrive ----------------------------
PUBLISHER_KEYS = [Ed25519PrivateKey.from_private_bytes(bytes([i]) * 32) for i in range(1, 5)]
PUBLISHERS = [ed25519_text(key) for key in PUBLISHER_KEYS]
published_records = st.lists(st.builds(
    PublishedModel, st.just("tiny"), st.sampled_from(["ab" * 32, "cd" * 32, "ef" * 32]), st.integers(1, 10**6),
    st.integers(0, 10**9), st.floats(0, 1e10), st.sampled_from(PUBLISHERS)), max_size=8)


@FUZZ
@given(records=published_records, trusted=st.sets(st.sampled_from(PUBLISHERS)),
       pinned=st.one_of(st.none(), st.sampled_from(PUBLISHERS)))
def test_a_name_resolves_only_to_a_record_of_a_trusted_or_named_publisher(records, trusted, pinned):
    trust = PublisherTrust.of(sorted(trusted)) if trusted else PublisherTrust(frozenset(), True)
    reference = "tiny" if pinned is None else f"tiny@{author_id(pinned)}"
    try:
        chosen = choose_published(records, reference, trust)
    except WeightsError:
        trusted_ids = {r.model_id for r in records if r.publisher in trusted}
        assert pinned is not None or len(trusted_ids) != 1, "one trusted model id must resolve"
        return
    assert chosen in records
    assert chosen.publisher == pinned if pinned is not None else chosen.publisher in trusted
    if pinned is None:  # strangers' records change nothing: the same choice without them
        assert choose_published([r for r in records if r.publisher in trusted], reference, trust) == chosen
    assert not PublisherTrust.of(["none"]).trusts(chosen.publisher)


@FUZZ
@given(texts=st.lists(st.text(max_size=60), max_size=4))
@example(texts=["~0"])  # found by this test: a home directory of no user made expanduser raise RuntimeError
@example(texts=["a\x00b", "x" * 60])
def test_trusted_publishers_are_keys_none_or_a_clear_error(texts, tmp_path_factory):
    try:
        trust = PublisherTrust.of(texts, governance_keys=[PUBLISHERS[0]])
    except TrustError as error:
        assert "trusted publishers" in str(error)
        return
    assert trust.keys <= set(PUBLISHERS) or not trust.names
