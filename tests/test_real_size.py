"""Issue 17 ("Real size"): one dtype end to end, approximate servers, the head over the rows the sampler reads,
the wire in the compute dtype, and the device checks. The real-width figures come from
``python -m swarm.benchmark realscale``, not from these tests."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import swarm
from swarm.client import DistributedDiffusionLM
from swarm.client.routing import MissingBlocksError
from swarm.diffusion.remasking import STRATEGIES
from swarm.models.loading import ModelFiles, resolve_device
from swarm.server.__main__ import main as server_main
from swarm.utils.errors import EXIT_USAGE
from swarm.wire.encoding import decode_tensor, encode_tensor
from tests.test_formats import dream_path, llada_path  # noqa: F401  (module fixtures: small bfloat16 checkpoints)

PROMPT = "def add(a, b):"
SHORT = dict(gen_length=16, steps=16, block_length=8, seed=3)
SETTINGS = {
    "greedy": {},
    "temperature": dict(temperature=0.8),
    **{f"remasking={name}": dict(remasking=name, temperature=0.5) for name in STRATEGIES},
    "threshold": dict(threshold=0.3, temperature=0.5),
    "cfg": dict(cfg_scale=1.5, temperature=0.5),
    "dual cache": dict(cache="dual", temperature=0.5),
    "prefix cache": dict(cache="prefix", temperature=0.5),
    "staleness": dict(staleness=2, temperature=0.5),
    "picard window": dict(parallel_window=3, temperature=0.5),
    "experts and corrector": dict(experts={"code": 1.0}, corrector_steps=1, temperature=0.5),
}


@pytest.fixture(scope="module")
def default_models():
    """The embedded model with the head over the active rows (the default) and over every row."""
    return (swarm.DiffusionLM.from_pretrained("default"),
            swarm.DiffusionLM.from_pretrained("default", head_rows="all"))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_head_over_active_rows_gives_the_full_heads_tokens(default_models, name):
    active, full = default_models
    settings = dict(SHORT, **SETTINGS[name])
    assert active.generate(PROMPT, **settings).token_ids == full.generate(PROMPT, **settings).token_ids


def test_head_over_active_rows_with_dreams_shift(dream_path):  # noqa: F811
    """Dream scores row i from hidden row i - 1: the shift must survive computing only the block's rows."""
    settings = dict(gen_length=8, steps=8, block_length=4, seed=1, temperature=0.5)
    for extra in ({}, dict(cache="dual"), dict(cfg_scale=1.0)):
        active = swarm.DiffusionLM.from_pretrained(dream_path).generate("the cat sat", **settings, **extra)
        full = swarm.DiffusionLM.from_pretrained(dream_path, head_rows="all").generate("the cat sat", **settings,
                                                                                        **extra)
        assert active.token_ids == full.token_ids, extra


def test_score_rows_computes_only_the_rows_asked(dream_path):  # noqa: F811
    """The rows asked equal the full head's; every other row is NaN (a reader of it would fail loudly)."""
    files = ModelFiles(dream_path)
    head = files.head("float32")
    hidden = torch.randn(2, 12, files.config.hidden_size)
    full = head(hidden)
    for offset, scored in ((0, (5, 9)), (4, (5, 9)), (0, (0, 12))):
        part = head.score_rows(hidden[:, offset:], offset, scored)
        rows = slice(scored[0] - offset, scored[1] - offset)
        torch.testing.assert_close(part[:, rows], full[:, offset:][:, rows] if offset == 0 else head(
            hidden[:, offset:])[:, rows])
        others = torch.ones(part.shape[1], dtype=torch.bool)
        others[rows] = False
        assert torch.isnan(part[:, others]).all()


def test_checkpoint_dtype_is_the_default_everywhere(llada_path, tiny_model_path):  # noqa: F811
    """bfloat16 for the published layouts (as their config says), float32 for the project's own models."""
    assert ModelFiles(llada_path).default_dtype == torch.bfloat16
    lm = swarm.DiffusionLM.from_pretrained(llada_path)
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}
    assert swarm.DiffusionLM.from_pretrained(llada_path, dtype="float32").model.embedding.embed.weight.dtype \
        == torch.float32
    assert ModelFiles(tiny_model_path).default_dtype == torch.float32


def test_bfloat16_on_the_wire_is_lossless_and_half_the_bytes():
    hidden = torch.randn(1, 64, 256).to(torch.bfloat16)
    auto, wide = encode_tensor(hidden), encode_tensor(hidden, "float32")
    assert torch.equal(decode_tensor(auto), hidden)  # the compute dtype travels as is: exact
    assert decode_tensor(auto).dtype == torch.bfloat16
    assert 0.49 < auto.ByteSize() / wide.ByteSize() < 0.51
    assert decode_tensor(encode_tensor(hidden.float())).dtype == torch.float32  # float32 models stay float32


@pytest.mark.swarm
def test_cuda_device_without_cuda_is_a_clear_error(tiny_model_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="CUDA is not available"):
        swarm.DiffusionLM.from_pretrained(tiny_model_path, device="cuda")
    assert resolve_device("cpu") == torch.device("cpu")
    # the server command, in this process as tests/test_cli.py runs commands (a `python -m swarm.server` spent 2 CPU s
    # importing torch to print this line): it refuses the device before it opens any socket or reads any weight
    done = CliRunner().invoke(server_main, ["--model", str(tiny_model_path), "--blocks", "0:1", "--device", "cuda"])
    assert done.exit_code == EXIT_USAGE and "CUDA is not available" in done.stderr, done.output[-2000:]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_servers_give_the_local_cuda_models_tokens(local_swarm, llada_path):  # noqa: F811
    """The GPU path (benchmarks/gpu_check.sh runs it when a GPU is lent): a local model on CUDA, and two
    ``--device cuda`` servers with default settings. The client's embedding and head stay on the CPU, whose
    bfloat16 rounding differs from the GPU's, so the tokens are compared position by position, not required equal."""
    settings = dict(gen_length=8, steps=8, block_length=8, seed=1, temperature=0.5)
    expected = swarm.DiffusionLM.from_pretrained(llada_path, device="cuda").generate("the cat sat", **settings)
    assert len(expected.token_ids) == 8
    layers = ModelFiles(llada_path).config.num_layers
    servers = [local_swarm.start_server(str(llada_path), span, "--device", "cuda", "--dht-prefix", "cuda-test",
                                        wait=False) for span in ("0:1", f"1:{layers}")]
    try:
        for server in servers:
            local_swarm.wait_ready(server)
        with DistributedDiffusionLM.from_pretrained(llada_path, initial_peers=local_swarm.initial_peers,
                                                    dht_prefix="cuda-test") as lm:
            tokens = lm.generate("the cat sat", **settings).token_ids
            assert sum(a == b for a, b in zip(tokens, expected.token_ids)) >= 6, (tokens, expected.token_ids)
    finally:
        for server in servers:
            local_swarm.terminate(server)


def test_approximate_server_is_avoided_unless_allowed(local_swarm, tiny_model_path, swarm_peer):
    """A bfloat16 server of a float32 checkpoint announces itself approximate: the default route avoids it (here
    nothing else holds its blocks, so the route is refused); allowed, it is used and named in the result."""
    prefix = "approximate-test"
    exact = local_swarm.start_server(str(tiny_model_path), "0:2", "--dht-prefix", prefix, "--compute-threads", "1",
                                     wait=False)
    approximate = local_swarm.start_server(str(tiny_model_path), "2:4", "--dht-prefix", prefix, "--dtype", "bfloat16",
                                           "--compute-threads", "1", wait=False)
    settings = dict(gen_length=8, steps=8, block_length=8, seed=1)
    try:
        for server in (exact, approximate):
            local_swarm.wait_ready(server)
        with DistributedDiffusionLM.from_pretrained(tiny_model_path, dht=swarm_peer, dht_prefix=prefix,
                                                    request_timeout=20) as lm:
            with pytest.raises(MissingBlocksError):
                lm.generate("hi", **settings)
            records = lm.planner.servers.values()
            assert sorted(r.numerics for r in records) == ["bfloat16 instead of the checkpoint's float32", "exact"]
        with DistributedDiffusionLM.from_pretrained(tiny_model_path, dht=swarm_peer, dht_prefix=prefix,
                                                    request_timeout=20, allow_approximate=True) as lm:
            result = lm.generate("hi", **settings)
            assert len(result.info["approximate"]) == 1
            assert result.info["approximate"][0].endswith("[2:4]: bfloat16 instead of the checkpoint's float32")
            assert lm.caller.bytes_sent > 0 and lm.caller.bytes_received > 0
    finally:
        for server in (exact, approximate):
            local_swarm.terminate(server)


def test_numerics_travel_in_records_and_the_health_map():
    """What a server announces (another dtype, int8) survives the record round trip and reaches the health map;
    a hostile record cannot make the text unbounded, and a record without the field reads as exact."""
    from swarm.dht.schema import MAX_NUMERICS_CHARS, ServerRecord, ServerState
    from swarm.health.map import server_json
    from swarm.models.loading import EXACT, numerics

    assert numerics(torch.bfloat16, torch.bfloat16) == EXACT
    assert numerics(torch.bfloat16, torch.bfloat16, "int8") == "int8 weights"
    assert numerics(torch.bfloat16, torch.float32) == "float32 instead of the checkpoint's bfloat16"
    record = ServerRecord("peer", ServerState.ONLINE, 0, 2, 10.0, numerics="int8 weights")
    parsed = ServerRecord.from_value("peer", record.to_value())
    assert parsed.approximate and server_json(parsed)["numerics"] == "int8 weights"
    old = record.to_value()
    del old["numerics"]
    assert not ServerRecord.from_value("peer", old).approximate
    hostile = dict(record.to_value(), numerics="x" * 10_000)
    assert len(ServerRecord.from_value("peer", hostile).numerics) == MAX_NUMERICS_CHARS



@pytest.mark.parametrize("shape", [(512, 4096), (520, 4096), (3, 4096)], ids=str)
def test_realscale_draws_its_bfloat16_weights_in_chunks_bit_for_bit(shape):
    """The 8B-width checkpoint's weights drawn in float32 chunks (no 5 GB float32 draw) are the whole draw's
    numbers: two whole chunks, a short last chunk, one short chunk."""
    from swarm.benchmark.realscale import normal_bfloat16

    whole = torch.empty(shape).normal_(0, 0.02, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    drawn = normal_bfloat16(shape, 0.02, torch.Generator().manual_seed(5))
    assert drawn.dtype == torch.bfloat16 and drawn.shape == shape
    assert torch.equal(drawn, whole)
