"""The kill switch: signed records, unknown keys, replays; and a halt stopping a live generation."""
from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarm.governance.keys import generate_private_key, load_private_key, parse_public_key, public_key_text
from swarm.governance.records import HALT, RESUME, GovernanceState, sign_decision


def subkey(key, action):
    return f"{public_key_text(key)}|{action}"


def test_key_files_round_trip_and_are_not_overwritten(tmp_path):
    path = tmp_path / "gov.key"
    key = generate_private_key(path)
    assert public_key_text(load_private_key(path)) == public_key_text(key)
    assert public_key_text(parse_public_key(public_key_text(key))) == public_key_text(key)
    with pytest.raises(FileExistsError):
        generate_private_key(path)
    with pytest.raises(ValueError, match="Ed25519"):
        parse_public_key("not a key")


def test_valid_halt_is_adopted_and_newer_resume_wins():
    key = Ed25519PrivateKey.generate()
    state = GovernanceState("model", [key.public_key()])
    halt = sign_decision(key, "model", HALT, "incident", timestamp=time.time() - 10)
    assert state.consider(subkey(key, HALT), halt).halted and state.halted
    resume = sign_decision(key, "model", RESUME, "fixed", timestamp=time.time() - 5)
    state.consider(subkey(key, RESUME), resume)
    assert not state.halted
    # A replay of the old halt changes nothing, for a reader that saw the resume or one that reads both.
    assert state.consider(subkey(key, HALT), halt) is None and not state.halted
    fresh = GovernanceState("model", [key.public_key()])
    for sk, value in sorted([(subkey(key, RESUME), resume), (subkey(key, HALT), halt)]):
        fresh.consider(sk, value)
    assert not fresh.halted


def test_unknown_key_bad_signature_wrong_prefix_and_future_are_ignored():
    trusted, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    state = GovernanceState("model", [trusted.public_key()])
    assert state.consider(subkey(other, HALT), sign_decision(other, "model", HALT, "x")) is None
    forged = sign_decision(other, "model", HALT, "x")
    assert state.consider(subkey(trusted, HALT), forged) is None, "signature by another key under a trusted subkey"
    assert state.consider(subkey(trusted, HALT), sign_decision(trusted, "other-model", HALT, "x")) is None
    assert state.consider(subkey(trusted, HALT), sign_decision(trusted, "model", HALT, "x", time.time() + 3600)) is None
    assert state.consider(subkey(trusted, HALT), {"payload": b"junk", "signature": b"junk"}) is None
    assert state.consider(subkey(trusted, HALT), "not a record") is None
    assert not state.halted
