"""Sharing adapters (issue 19, item 4): publish under a name signed by the author's key, serve the files from any
server, use them by name; and the attacks: forged or moved records, a host sending other bytes, oversized files.

Everything runs on the real DHT of the session's local swarm; the lying hosts are the server's real RPC handler
(``ForwardHandler``) on a real libp2p peer in this process, given tampered files.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time

import pytest
import torch
from click.testing import CliRunner

from swarm.adapters.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterConfig, AdapterError, SoftPrompt, base_of
from swarm.adapters.sharing import (
    MAX_ADAPTER_BYTES,
    PUBLISH_LIFETIME,
    AdapterLibrary,
    content_hash,
    declare_hosted,
    make_record,
    name_key,
    publish,
    read_adapter_files,
    read_published,
)
from swarm.dht.identity import Identity
from swarm.dht.node import NetworkConfig, start_dht, stop_dht
from swarm.dht.schema import now
from swarm.dht.validation import sign_slot, slot_subkey
from swarm.finetune.publish import publish_main
from swarm.governance.keys import generate_private_key
from swarm.health.__main__ import main as health_main
from swarm.health.map import read_health_map
from swarm.health.render import render_text
from swarm.server.handler import ForwardHandler
from swarm.utils.event_loop import BackgroundLoop

GENERATION = dict(gen_length=16, steps=16, block_length=8)


def make_adapter(lm, directory, seed: int, length: int = 4):
    config = AdapterConfig(length, lm.config.hidden_size, base_of(lm.config, lm.tokenizer), training={"steps": 7})
    prompts = torch.randn(length, lm.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    return SoftPrompt(config, prompts).save(directory)


@pytest.fixture(scope="module")
def peer(local_swarm):
    """A DHT peer of this process on the session's swarm, with a libp2p identity (for host records)."""
    identity = Identity.load_or_create()
    dht = start_dht(NetworkConfig(initial_peers=local_swarm.initial_peers), identity=identity)
    yield dht, identity
    stop_dht(dht)
    identity.remove()


@pytest.fixture()
def cache(remote_lm, tmp_path, monkeypatch):
    monkeypatch.setattr(remote_lm, "adapter_cache", tmp_path / "cache")
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def lying_host(peer, remote_lm):
    """The server's adapter RPC on this process's peer; ``serve(files, as_hash)`` makes it serve ``files`` as if
    they were the content ``as_hash`` and announces that under its own (provable) peer id."""
    dht, identity = peer
    handler = ForwardHandler(None, hidden_size=remote_lm.config.hidden_size, max_batch_tokens=64, wire_dtype="auto",
                             request_timeout=10.0, info=dict)
    handler.adapters = AdapterLibrary()
    loop = BackgroundLoop.shared()
    p2p = loop.run(dht.replicate_p2p())
    loop.run(handler.add_p2p_handlers(p2p))
    addresses = [str(a).rsplit("/p2p/", 1)[0] for a in loop.run(p2p.get_visible_maddrs())]

    def serve(files: dict[str, bytes], as_hash: str) -> None:
        handler.adapters.files[as_hash] = files
        assert declare_hosted(dht, remote_lm.prefix, {as_hash: 1}, identity.owner_subkey(), now() + 120, addresses)

    yield serve
    loop.run(handler.remove_p2p_handlers(p2p))


@contextlib.contextmanager
def served_and_published(local_swarm, model_path, directory, name: str, tmp_path, *options: str):
    """A server hosting ``directory`` (``--serve-adapter``) while the publish command, run with a fresh author key
    and ``options``, publishes it as ``name``; yields the command's result. The server stops afterwards."""
    key_path = tmp_path / "author.key"
    generate_private_key(key_path)
    host = local_swarm.start_server(str(model_path), "3:4", "--throughput", "0.001", "--compute-threads", "1",
                                    "--serve-adapter", str(directory))
    try:
        peers = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
        result = CliRunner().invoke(publish_main, [str(directory), "--name", name, "--key", str(key_path), *options,
                                                   "--model", str(model_path), *peers])
        assert result.exit_code == 0, result.output
        yield result
    finally:
        local_swarm.terminate(host)


def test_publish_serve_and_generate_by_name(local_swarm, remote_lm, local_lm, tiny_model_path, tmp_path, cache):
    directory = make_adapter(local_lm, tmp_path / "adapter", seed=1)
    with served_and_published(local_swarm, tiny_model_path, directory, "shared-one", tmp_path,
                              "--score", "0.5") as result:
        peers = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
        published = json.loads(result.stdout)
        assert published["sha256"] == content_hash(read_adapter_files(directory))
        assert published["score"] == 0.5 and published["training"]["steps"] == 7
        assert published["served_by"], "the publisher saw the server announcing the content"

        by_name = remote_lm.generate("adapt", adapter="shared-one", **GENERATION)
        by_directory = local_lm.generate("adapt", adapter=str(directory), **GENERATION)
        assert by_name.token_ids == by_directory.token_ids
        assert by_name.token_ids != local_lm.generate("adapt", **GENERATION).token_ids  # the adapter matters
        cached_weights = cache / published["sha256"] / ADAPTER_WEIGHTS
        assert cached_weights.read_bytes() == (directory / ADAPTER_WEIGHTS).read_bytes()

        health = CliRunner().invoke(health_main, ["--model", str(tiny_model_path), "--json", *peers])
        listed = {a["name"]: a for a in json.loads(health.stdout)["adapters"]}
        assert listed["shared-one"]["sha256"] == published["sha256"] and listed["shared-one"]["hosts"]
        # as text: the command's renderer, on the map it reads (a second run of the command is a DHT peer and
        # daemon of its own, ~1 CPU s)
        text = render_text(read_health_map(remote_lm.dht, remote_lm.prefix, 4, adapters=True))
        assert f"shared-one@{published['author']}" in text
    with pytest.raises(AdapterError, match="no adapter is published under 'nobody-published-this'"):
        remote_lm.generate("adapt", adapter="nobody-published-this", **GENERATION)


# ----- attacks -------------------------------------------------------------------------------------------
def test_a_record_without_the_authors_key_is_refused_and_not_read(peer, remote_lm, local_lm, tmp_path):
    dht, _ = peer
    author, impostor = (generate_private_key(tmp_path / name) for name in ("author.key", "impostor.key"))
    record = make_record(make_adapter(local_lm, tmp_path / "a", seed=2), "signed-name", None, [])
    prefix = remote_lm.prefix
    stored = publish(dht, author, prefix, record)
    assert stored.author_id and read_published(dht, prefix, "signed-name") == [stored]

    # The impostor signs a record into the author's slot: the storing peers refuse it, readers keep the author's.
    forged = dataclasses.replace(record, sha256="0" * 64, published=time.time())
    expiration = now() + PUBLISH_LIFETIME + 600  # later than the author's: it would replace it if it were valid
    value = sign_slot(impostor, name_key(prefix, "signed-name"), forged.payload(), expiration)
    assert not dht.store(name_key(prefix, "signed-name"), value, expiration_time=expiration,
                         subkey=slot_subkey(author))
    # The author's genuine signature, moved to another name, does not hold there either.
    genuine = sign_slot(author, name_key(prefix, "signed-name"), record.payload(), expiration)
    assert not dht.store(name_key(prefix, "moved-name"), genuine, expiration_time=expiration,
                         subkey=slot_subkey(author))
    # An unsigned value under a plain subkey may be stored, but is never read as a record.
    dht.store(name_key(prefix, "signed-name"), {"payload": forged.payload()}, expiration_time=expiration,
              subkey="anyone")
    assert read_published(dht, prefix, "signed-name") == [stored]
    assert read_published(dht, prefix, "moved-name") == []

    # Another author may use the same name in their own slot: a client then refuses to guess.
    other = publish(dht, impostor, prefix, dataclasses.replace(forged, sha256="1" * 64))
    with pytest.raises(AdapterError, match="several authors published 'signed-name'"):
        remote_lm.load_adapter("signed-name")
    with pytest.raises(AdapterError, match="no peer serves"):  # name@AUTHOR picks one: nobody serves it here
        remote_lm.load_adapter(f"signed-name@{other.author_id}")


def test_a_host_sending_other_bytes_is_refused(peer, lying_host, remote_lm, local_lm, tmp_path, cache):
    dht, _ = peer
    record = make_record(make_adapter(local_lm, tmp_path / "good", seed=3), "tampered", None, [])
    publish(dht, generate_private_key(tmp_path / "k"), remote_lm.prefix, record)
    files = read_adapter_files(tmp_path / "good")
    weights = bytearray(files[ADAPTER_WEIGHTS])
    weights[-1] ^= 1  # one flipped bit in the last float: same size, still a valid adapter
    lying_host({ADAPTER_CONFIG: files[ADAPTER_CONFIG], ADAPTER_WEIGHTS: bytes(weights)}, record.sha256)
    with pytest.raises(AdapterError, match="sha256 differs from the published one"):
        remote_lm.load_adapter("tampered")
    assert not (cache / record.sha256).exists()


def test_oversized_adapters_are_refused(peer, lying_host, remote_lm, local_lm, tmp_path, cache):
    dht, _ = peer
    key = generate_private_key(tmp_path / "k")
    good = make_adapter(local_lm, tmp_path / "good", seed=4)
    record = make_record(good, "too-big-record", None, [])
    # A record declaring more than the limit is refused before anything is fetched.
    publish(dht, key, remote_lm.prefix, dataclasses.replace(record, size=MAX_ADAPTER_BYTES + 1))
    with pytest.raises(AdapterError, match="over the limit"):
        remote_lm.load_adapter("too-big-record")
    # A host streaming more bytes than the record declares is cut off.
    files = read_adapter_files(good)
    bloated = {ADAPTER_CONFIG: files[ADAPTER_CONFIG], ADAPTER_WEIGHTS: files[ADAPTER_WEIGHTS] + b"\0" * 2**20}
    publish(dht, key, remote_lm.prefix, dataclasses.replace(record, name="bloated"))
    lying_host(bloated, record.sha256)
    with pytest.raises(AdapterError, match="too_large"):
        remote_lm.load_adapter("bloated")
    # A server refuses to serve an oversized adapter directory at all.
    big = tmp_path / "big"
    big.mkdir()
    (big / ADAPTER_CONFIG).write_bytes(files[ADAPTER_CONFIG])
    with open(big / ADAPTER_WEIGHTS, "wb") as handle:
        handle.truncate(MAX_ADAPTER_BYTES)  # sparse: costs no disk
    with pytest.raises(AdapterError, match="over the limit"):
        AdapterLibrary([str(big)])


def test_an_adapter_for_another_base_model_is_refused_before_fetching(peer, remote_lm, local_lm, tmp_path, cache):
    dht, _ = peer
    record = make_record(make_adapter(local_lm, tmp_path / "a", seed=5), "other-base", None, ["12D3KooWnobody"])
    other = dict(record.base, hidden_size=record.base["hidden_size"] * 2)
    publish(dht, generate_private_key(tmp_path / "k"), remote_lm.prefix, dataclasses.replace(record, base=other))
    with pytest.raises(AdapterError, match="trained on another base model: hidden_size"):
        remote_lm.load_adapter("other-base")
