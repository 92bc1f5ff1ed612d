"""Receipts and proofs, in process (issue 55, class 5): a server's signed answer to a real call is evidence anyone
holding the blocks recomputes; a wrong answer is a proof against its signer; a forged proof (a lie that is not one,
a receipt the accused never signed, an altered call or answer, another model, a fill the server never used) punishes
nobody; approximate servers are not provable; the evidence parser is bounded and fuzzed."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.client.proofs import Verdict, verify_evidence
from swarm.client.receipts import ReceiptBook, as_evidence
from swarm.client.reference import LocalReference
from swarm.diffusion.pipeline import CacheDirective
from swarm.diffusion.prediction import HeadQuery
from swarm.models.kv_cache import SpanKV
from swarm.models.loading import ModelFiles
from swarm.server.backend import SpanBackend, SpanCall
from swarm.wire.encoding import encode_tensor
from swarm.wire.evidence import CallEvidence
from swarm.wire.messages import ForwardRequest, RemoteError
from swarm.wire.receipts import CallContent, Receipt, ReceiptSigner, tensor_digest
from swarm.wire.remote import SignedCall
from tests.conftest import make_checkpoint, tiny_config

pytestmark = pytest.mark.unit
PREFIX = "receipts-model"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    files = ModelFiles(make_checkpoint(tmp_path_factory.mktemp("receipts") / "m", tiny_config(), seed=3))
    config = files.config
    backend = SpanBackend(files.span(0, config.num_layers), 1, head=files.head())
    reference = LocalReference(lambda start, end: files.span(start, end), files.head, config.num_layers)
    return files, config, backend, reference


@pytest.fixture(scope="module")
def server_key():
    return RSAPrivateKey()


def served(backend, signer: ReceiptSigner, request: ForwardRequest, kv=None, fill: bytes = b"",
           lie: bool = False) -> SignedCall:
    """What a server does with ``request``: compute, (optionally) perturb, encode and sign; the client's view."""
    call = SpanCall(request.hidden, request.start, request.end, kv,
                    request.cache.rows if request.cache is not None else None, request.head, request.adapter)
    output = backend.forward_sync(call)
    if lie and output.dtype == torch.float64:
        output = output.clone()
        output[..., 0, 0] = (output[..., 0, 0] + 1) % 200
    elif lie:
        output = output + 0.05 * output.std() * torch.randn_like(output)
    hidden, answer = encode_tensor(request.hidden), encode_tensor(output)
    receipt = signer.sign(content_of(request, hidden).digest(), tensor_digest(answer), fill)
    return SignedCall("", request, receipt, hidden, answer)


def content_of(request: ForwardRequest, hidden) -> CallContent:
    return CallContent(request.start, request.end, request.session_id, request.step,
                       request.cache.to_dict() if request.cache is not None else None,
                       request.head.to_dict() if request.head is not None else None, None, None, tensor_digest(hidden))


def plain_request(config, seed: int = 0, rows: int = 6) -> ForwardRequest:
    generator = torch.Generator().manual_seed(seed)
    return ForwardRequest(0, config.num_layers, torch.randn(1, rows, config.hidden_size, generator=generator), "s", 3)


def check(evidence: CallEvidence, model, prefix: str = PREFIX):
    _, config, _, reference = model
    return verify_evidence(CallEvidence.from_bytes(evidence.to_bytes()), reference, prefix, config)


def test_an_honest_answer_verifies_and_a_signed_wrong_one_is_a_proof_against_its_signer(model, server_key):
    _, config, backend, _ = model
    signer = ReceiptSigner(server_key, PREFIX, exact=True, invariant=True)
    request = plain_request(config)
    honest = check(as_evidence(served(backend, signer, request)), model)
    assert honest.verdict == Verdict.HONEST and honest.difference == 0.0, honest
    lie = check(as_evidence(served(backend, signer, request, lie=True)), model)
    assert lie.verdict == Verdict.LIE and lie.accused == signer_peer(signer), lie


def signer_peer(signer: ReceiptSigner) -> str:
    return Receipt(PREFIX, b"0" * 32, b"0" * 32, b"", True, True, 0.0, signer.owner_key).peer_id


def test_a_head_query_lie_is_proven_on_its_predicted_tokens(model, server_key):
    _, config, backend, _ = model
    signer = ReceiptSigner(server_key, PREFIX, exact=True, invariant=True)
    query = HeadQuery((0,), 6, (0,), seed=1, temperature=0.0, cfg_scale=0.0, mask_token_id=config.mask_token_id,
                      scored=(0, 6))
    request = dataclasses.replace(plain_request(config), head=query)
    assert check(as_evidence(served(backend, signer, request)), model).verdict == Verdict.HONEST
    assert check(as_evidence(served(backend, signer, request, lie=True)), model).verdict == Verdict.LIE


def test_forged_proofs_punish_nobody(model, server_key):
    """A lie that is not one (an honest answer presented as a proof), a receipt signed by another key in the accused's
    name, an answer or a call altered after signing, another model's prefix: none of them accuses anybody."""
    _, config, backend, _ = model
    signer = ReceiptSigner(server_key, PREFIX, exact=True, invariant=True)
    request = plain_request(config, seed=1)
    honest = as_evidence(served(backend, signer, request))
    assert check(honest, model).verdict == Verdict.HONEST  # "it lied" said of a right answer: no accusation
    forger = ReceiptSigner(RSAPrivateKey(), PREFIX, exact=True, invariant=True)
    wrong = served(backend, forger, request, lie=True)
    in_their_name = dataclasses.replace(wrong.receipt, owner_key=signer.owner_key)
    forged = dataclasses.replace(as_evidence(wrong), receipt=in_their_name)
    altered_answer = dataclasses.replace(honest, answer=served(backend, signer, request, lie=True).answer)
    other_call = dataclasses.replace(honest, step=4)
    for evidence, why in ((forged, "signature"), (altered_answer, "answer"), (other_call, "call")):
        finding = check(evidence, model)
        assert finding.verdict == Verdict.INVALID and finding.accused is None and why in finding.reason, finding
    finding = check(as_evidence(served(backend, signer, request, lie=True)), model, prefix="another-model")
    assert finding.verdict == Verdict.INVALID and "model" in finding.reason


def test_approximate_servers_are_not_provable_and_non_invariant_ones_get_a_looser_bound(model, server_key):
    _, config, backend, _ = model
    request = plain_request(config, seed=2)
    approximate = ReceiptSigner(server_key, PREFIX, exact=False, invariant=True)
    assert check(as_evidence(served(backend, approximate, request, lie=True)), model).verdict == Verdict.UNPROVABLE
    loose = ReceiptSigner(server_key, PREFIX, exact=True, invariant=False)
    assert check(as_evidence(served(backend, loose, request, lie=True)), model).verdict == Verdict.LIE


def test_a_reuse_is_proven_with_the_fill_its_receipt_names_and_no_other(model, server_key):
    """The reuse's receipt names the fill's digest: its evidence carries that fill; a fill swapped for another one
    of the same session and version (the client's framing) is refused; a server that names a fill the client never
    sent fails the call."""
    _, config, backend, _ = model
    signer = ReceiptSigner(server_key, PREFIX, exact=True, invariant=True)
    book = ReceiptBook(share=1.0)
    fill_request = dataclasses.replace(plain_request(config, seed=5, rows=12), cache=CacheDirective(0))
    kv = SpanKV(1, 12)
    fill = dataclasses.replace(served(backend, signer, fill_request, kv), peer_id="p")
    book.record(fill)
    generator = torch.Generator().manual_seed(6)
    reuse_request = ForwardRequest(0, config.num_layers, torch.randn(1, 4, config.hidden_size, generator=generator),
                                   "s", 4, cache=CacheDirective(0, (4, 8)))
    for lie in (False, True):
        reuse = dataclasses.replace(served(backend, signer, reuse_request, kv, fill.receipt.request, lie), peer_id="p")
        book.record(reuse)
        evidence = book.evidence(reuse)
        assert check(evidence, model).verdict == (Verdict.LIE if lie else Verdict.HONEST)
    other_fill = dataclasses.replace(fill_request, hidden=fill_request.hidden + 1)
    swapped = dataclasses.replace(evidence, fill=as_evidence(served(backend, signer, other_fill, SpanKV(1, 12)))
                                  .without_answer())
    assert check(swapped, model).verdict == Verdict.INVALID
    bogus = dataclasses.replace(served(backend, signer, reuse_request, kv, b"\1" * 32), peer_id="p")
    with pytest.raises(RemoteError, match="names fill"):
        book.record(bogus)


def test_private_calls_are_never_kept_and_the_sample_is_bounded(model, server_key):
    _, config, backend, _ = model
    signer = ReceiptSigner(server_key, PREFIX, exact=True, invariant=True)
    book = ReceiptBook(share=1.0)
    with book.private():
        book.record(served(backend, signer, plain_request(config)))
    assert book.sample() == [] and len(book.receipts) == 1
    for seed in range(70):
        book.record(served(backend, signer, plain_request(config, seed, rows=2)))
    assert len(book.sample()) == 64


# ----- the parser, fuzzed ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def valid_map(model, server_key):
    _, config, backend, _ = model
    return as_evidence(served(backend, ReceiptSigner(server_key, PREFIX, True, True), plain_request(config))).to_map()


# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=2048))
def test_random_bytes_are_refused_with_value_error(data):
    with pytest.raises(ValueError):
        CallEvidence.from_bytes(data)


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=20),
                   st.binary(max_size=40), st.lists(st.integers(-5, 2**30), max_size=5),
                   st.dictionaries(st.text(max_size=8), st.integers(-2**63, 2**63 - 1), max_size=4))


# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_valid_evidence_with_any_field_replaced_parses_or_is_refused_cleanly(valid_map, model, data):
    """Any field (or a receipt's, or a tensor's) replaced by any value: a ValueError, or evidence whose verdict is
    never a lie (the receipt no longer signs it)."""
    mutated = msgpack.unpackb(msgpack.packb(valid_map, use_bin_type=True), raw=False)
    where = data.draw(st.sampled_from(["top", "receipt", "hidden", "answer"]))
    target = mutated if where == "top" else mutated[where]
    key = data.draw(st.sampled_from(sorted(target)))
    target[key] = data.draw(VALUES)
    try:
        evidence = CallEvidence.from_bytes(msgpack.packb(mutated, use_bin_type=True))
    except ValueError:
        return
    _, config, _, reference = model
    assert verify_evidence(evidence, reference, PREFIX, config).verdict != Verdict.LIE


def test_an_evidence_directory_yields_evidence_and_removes_junk(model, server_key, tmp_path):
    """What an auditor's ``--evidence-dir`` reads: saved samples come back as they were; a file that is not evidence
    is removed unread beyond its bound."""
    from swarm.audit import inbox
    from swarm.client.receipts import save_sample

    _, config, backend, _ = model
    signer = ReceiptSigner(server_key, PREFIX, exact=True, invariant=True)
    sample = [as_evidence(served(backend, signer, plain_request(config, seed))) for seed in range(3)]
    save_sample(sample, tmp_path)
    (tmp_path / "junk.evidence").write_bytes(b"\x92\x01")
    taken = list(inbox.take(tmp_path))
    assert sorted(e.receipt.request for _, e in taken) == sorted(e.receipt.request for e in sample)
    assert not (tmp_path / "junk.evidence").exists()
    kept = inbox.keep_proof(taken[0][0])
    assert kept.parent.name == inbox.PROOFS
    assert CallEvidence.from_bytes(kept.read_bytes()).receipt == taken[0][1].receipt


def test_a_call_too_long_to_recompute_accuses_nobody(model, server_key):
    """Evidence is remote input: a signed call longer than the model's context (or than a server's batch bound) is
    refused before any pass, never recomputed at the verifier's expense."""
    _, config, _, _ = model
    signer = ReceiptSigner(server_key, PREFIX, exact=True, invariant=True)
    request = plain_request(config, rows=config.max_position_embeddings + 1)
    hidden, answer = encode_tensor(request.hidden), encode_tensor(request.hidden)
    receipt = signer.sign(content_of(request, hidden).digest(), tensor_digest(answer))
    finding = check(as_evidence(SignedCall("", request, receipt, hidden, answer)), model)
    assert finding.verdict == Verdict.INVALID and "positions" in finding.reason, finding
