"""Batching across clients on a live server (issue 47 item 3): several clients generate at once through one server of
every block (with the head), which merges their waiting calls of equal length into one pass (by default: its passes
are batch-invariant, checked at start and announced); every client's tokens equal its solo run (the local model's),
greedy, sampled and with guidance (tests/test_batching_queue.py checks merged rows bitwise, and that merging happens,
without timing). Whether calls do meet in the queue here depends on timing, so that test asserts tokens only.
A server started with --no-batch-invariant announces so: clients at scale="auto" then batch no states through it."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from swarm.frontend.local import DiffusionLM
from tests.conftest import make_checkpoint, stop_all, swarm_client, tiny_config, wait_seen

REQUESTS = [  # one prompt length, so every call of every client may be merged with the others'
    ([65, 66, 67, 68], dict(temperature=0.0)),
    ([70, 71, 72, 73], dict(temperature=0.0)),
    ([80, 81, 82, 83], dict(temperature=0.7, seed=5)),
    ([90, 91, 92, 93], dict(temperature=0.0, cfg_scale=1.0)),
]
FAST = dict(gen_length=16, steps=8, block_length=8)


def test_concurrent_clients_get_their_solo_tokens_from_a_batching_server(local_swarm, tmp_path, swarm_peer):
    path = make_checkpoint(tmp_path / "batching", tiny_config(), seed=21)
    local = DiffusionLM.from_pretrained(path)
    solo = [local.generate(prompt, **FAST, **options).token_ids for prompt, options in REQUESTS]
    server = local_swarm.start_server(str(path), "0:4", "--head", "--compute-threads", "1")  # batching by default
    # four callers, four peer ids: the first joins through the module's DHT peer (the next test's client uses it too),
    # the others through their own (a DHT process and a libp2p daemon each)
    clients = [swarm_client(local_swarm, path, **({"dht": swarm_peer} if index == 0 else {}))
               for index in range(len(REQUESTS))]
    try:
        with ThreadPoolExecutor(len(clients)) as pool:  # each connected and challenged before they start together
            list(pool.map(lambda lm: lm.show_route(), clients))
        barrier = threading.Barrier(len(clients))

        def run(index: int) -> list[list[int]]:
            barrier.wait()
            prompt, options = REQUESTS[index]
            return [clients[index].generate(prompt, **FAST, **options).token_ids for _ in range(3)]

        with ThreadPoolExecutor(len(clients)) as pool:
            runs = list(pool.map(run, range(len(clients))))
        for index, tokens in enumerate(runs):
            assert all(run_tokens == solo[index] for run_tokens in tokens), f"client {index} got other tokens"
        info, _ = clients[0].loop.run(clients[0].caller.info(server.peer_id, 10))
        assert info["batching"] is True and info["batch_invariance"]["batch_invariant"] is True
        assert clients[0].planner.servers[server.peer_id].batch_invariant is True
        batching = clients[0].generate(REQUESTS[0][0], **FAST, **REQUESTS[0][1]).info["settings"]["batching"]
        assert batching == {"states_per_call": 4, "chosen_by": "scale", "batch_invariant": True,
                            "why": "every usable server (1) announces batch-invariant passes"}
        scheduler = info["admission"]["span"]["scheduler"]
        assert scheduler["queued"] == 0 and info["admission"]["span"]["in_flight"] == 0
        print(f"\nmerged passes: {scheduler['batches']}, requests in them: {scheduler['batched_requests']}")
    finally:
        for lm in clients:
            lm.shutdown()
        stop_all(local_swarm, [server])


def test_a_server_without_invariant_passes_says_so_and_auto_batches_no_states_through_it(local_swarm, tmp_path,
                                                                                          swarm_peer):
    path = make_checkpoint(tmp_path / "varying", tiny_config(), seed=22)
    expected = DiffusionLM.from_pretrained(path).generate(REQUESTS[0][0], **FAST, temperature=0.0).token_ids
    server = local_swarm.start_server(str(path), "0:4", "--head", "--compute-threads", "1", "--no-batch-invariant")
    try:
        with swarm_client(local_swarm, path, dht=swarm_peer) as lm:
            wait_seen(lm, [server])
            assert lm.planner.servers[server.peer_id].batch_invariant is False
            info, _ = lm.loop.run(lm.caller.info(server.peer_id, 10))
            assert info["batching"] is False and "SWARM_BATCH_INVARIANT=0" in info["batch_invariance"]["why"]
            result = lm.generate(REQUESTS[0][0], **FAST, temperature=0.0)  # scale="auto": drafts only if invariant
            batching = result.info["settings"]["batching"]
            assert batching["states_per_call"] == 1 and batching["batch_invariant"] is False
            assert server.peer_id[-8:] in batching["why"] and batching["why"].startswith("scale=auto batches no")
            assert result.token_ids == expected
    finally:
        stop_all(local_swarm, [server])


def test_the_concurrency_benchmarks_clients_share_one_embedding_and_head(tmp_path):
    """``swarm.benchmark concurrency`` runs its clients in one process on one ``SharedClientParts``: 16 clients of
    a checkpoint of LLaDA-8B's widths would otherwise hold 16 copies of 2 GB. One part per dtype, read as
    ``ModelFiles`` reads it."""
    import torch

    from swarm.benchmark.shared_parts import SharedClientParts
    from swarm.models.loading import ModelFiles

    path = make_checkpoint(tmp_path / "shared", tiny_config(), seed=3)
    parts, files = SharedClientParts(str(path)), ModelFiles(path)
    assert parts.embedding() is parts.embedding(files.default_dtype) and parts.head() is parts.head()
    assert parts.embedding("bfloat16") is parts.embedding(torch.bfloat16) is not parts.embedding()
    for shared, own in ((parts.embedding(), files.embedding()), (parts.head(), files.head())):
        assert shared.state_dict().keys() == own.state_dict().keys()
        assert all(torch.equal(shared.state_dict()[name], own.state_dict()[name]) for name in own.state_dict())
