"""Spot checks catch a server that returns wrong results; the answer stays the honest one."""
from __future__ import annotations

from pathlib import Path

import pytest

from swarm.client import DistributedDiffusionLM
from swarm.frontend.local import DiffusionLM
from tests.conftest import make_checkpoint, stop_all, tiny_config, wait_seen

FAULTY = (str(Path(__file__).with_name("faulty_server.py")),)
MISAPPLYING = (str(Path(__file__).with_name("misapplying_server.py")),)
SETTINGS = dict(gen_length=16, steps=8, block_length=8, seed=3, temperature=0.5)


@pytest.fixture(scope="module")
def audited_swarm(local_swarm, tmp_path_factory):
    """Two honest servers and one faulty one (announcing itself as the fastest) for the same blocks."""
    path = make_checkpoint(tmp_path_factory.mktemp("audited"), tiny_config(), seed=9)
    # The honest ones announce a low throughput, so that the route picks the faulty one whatever round trips a busy
    # machine measures.
    honest = [local_swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--throughput", "1", wait=False)
              for _ in range(2)]
    faulty = local_swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--throughput", "1e9",
                                      entry=FAULTY, name="faulty", wait=False)
    for server in honest + [faulty]:
        local_swarm.wait_ready(server)
    yield path, faulty
    stop_all(local_swarm, honest + [faulty])  # their own prefix


def test_faulty_server_is_caught_banned_and_tokens_stay_honest(local_swarm, audited_swarm, swarm_peer):
    path, faulty = audited_swarm
    expected = DiffusionLM.from_pretrained(path).generate("audit", **SETTINGS)
    with DistributedDiffusionLM.from_pretrained(path, dht=swarm_peer,
                                                spot_check_fraction=1.0) as lm:
        wait_seen(lm, [faulty])
        assert lm.show_route()[0].peer_id == faulty.peer_id, "the faulty server should be the first choice"
        result = lm.generate("audit", **SETTINGS)
        assert result.token_ids == expected.token_ids
        verdicts = [o.verdict for o in lm.sequence.spot_checker.outcomes]
        assert verdicts[0] == "primary_faulty"
        assert faulty.peer_id in lm.sequence.distrusted
        assert set(verdicts[1:]) == {"agreed"}, "after the catch only honest servers are used"


def test_without_spot_checks_the_faulty_server_changes_the_answer(local_swarm, audited_swarm, swarm_peer):
    """The control: the perturbation is large enough to matter, so the catch above is meaningful."""
    path, faulty = audited_swarm
    local = DiffusionLM.from_pretrained(path)
    with DistributedDiffusionLM.from_pretrained(path, dht=swarm_peer,
                                                spot_check_fraction=0) as lm:
        ids = __import__("torch").randint(0, 256, (1, 12))
        wait_seen(lm, [faulty])
        assert lm.show_route()[0].peer_id == faulty.peer_id
        difference = (lm.logits(ids) - local.logits(ids)).abs().max()
        assert difference > 1e-2


def test_a_server_that_lists_bottlenecks_and_misapplies_them_is_caught(local_swarm, tmp_path_factory, swarm_peer):
    """The subtle liar: its record says it applies bottleneck adapters, its plain passes are exact, and it adds a
    bottleneck's weights as a deep prompt (tests/misapplying_server.py). Spot checks resend the adapter with the
    request, so the fine-tuned tokens stay the local ones and the liar is distrusted."""
    from tests.test_bottleneck import bottleneck_for

    path = make_checkpoint(tmp_path_factory.mktemp("misapplying"), tiny_config(), seed=10)
    local = DiffusionLM.from_pretrained(path)
    adapter = str(bottleneck_for(local).save(tmp_path_factory.mktemp("misapplying-adapter") / "bottleneck"))
    honest = [local_swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--throughput", "1", wait=False)
              for _ in range(2)]  # two, so that a disagreement has a third opinion
    liar = local_swarm.start_server(str(path), "0:4", "--compute-threads", "1", "--throughput", "1e9",
                                    entry=MISAPPLYING, name="misapplying", wait=False)
    try:
        for server in (*honest, liar):
            local_swarm.wait_ready(server)
        with DistributedDiffusionLM.from_pretrained(path, dht=swarm_peer,
                                                    spot_check_fraction=0) as lm:  # checks off: the danger
            wait_seen(lm, [liar])
            assert lm.show_route()[0].peer_id == liar.peer_id, "the liar should be the first choice"
            assert lm.generate("audit", **SETTINGS).token_ids == local.generate("audit", **SETTINGS).token_ids
            unchecked = lm.generate("audit", adapter=adapter, **SETTINGS).token_ids
            assert unchecked != local.generate("audit", adapter=adapter, **SETTINGS).token_ids  # the danger is real
        with DistributedDiffusionLM.from_pretrained(path, dht=swarm_peer,
                                                    spot_check_fraction=1.0) as lm:
            for seed in range(2):
                options = dict(SETTINGS, seed=seed)
                assert (lm.generate("audit", adapter=adapter, **options).token_ids
                        == local.generate("audit", adapter=adapter, **options).token_ids)
            verdicts = [o.verdict for o in lm.sequence.spot_checker.outcomes]
            assert "primary_faulty" in verdicts and liar.peer_id in lm.sequence.distrusted
    finally:
        stop_all(local_swarm, [*honest, liar])  # their own prefix
