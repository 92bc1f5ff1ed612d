"""LoRA adapters (issue 19): low-rank corrections of every projection of every block, held by the client and
carried per hop packed in the per-block adapter tensor, like a bottleneck's weights.

The packed LoRA computes exactly what the merged weights ``W + up @ down`` compute; gradients through real servers
equal local autograd (float32); the same tokens locally and through the swarm (plain, dual cache, Picard windows);
servers refuse a tensor that is no LoRA and go on; bad files are refused; adapters saved before the base recorded
the model's widths still load; the command trains one through the swarm.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from swarm.adapters.adapter import ADAPTER_CONFIG, LAYOUT_KEYS, AdapterConfig, LoRAAdapter, PromptAdapter, base_of
from swarm.adapters.block import BlockAdapter
from swarm.adapters.kinds import BOTTLENECK, LORA
from swarm.adapters.lora import BlockWidths, unpack_lora
from swarm.finetune.trainer import STATE_FILE, FinetuneConfig, Finetuner
from swarm.wire.encoding import request_parts
from swarm.wire.messages import ErrorCode, ForwardRequest, RemoteError
from tests.conftest import holder_of
from tests.test_bottleneck import bottleneck_for
from tests.test_deep_prompt import _edit_json, adapter_gradient, assert_files_refused, raw_call
from tests.test_finetune import GENERATION, TOLERANCE, run_finetune, write_pairs


def lora_for(lm, rank: int = 2, seed: int = 0, scale: float = 0.3) -> LoRAAdapter:
    """Random down and up projections for every projection of every block (up nonzero: it changes the output)."""
    config = AdapterConfig(0, lm.config.hidden_size, base_of(lm.config, lm.tokenizer), LORA,
                           num_blocks=lm.config.num_layers, rank=rank)
    weights = scale * torch.randn(config.shape, generator=torch.Generator().manual_seed(seed))
    return LoRAAdapter(config, weights)


def merged_model(lm, adapter: LoRAAdapter):
    """A copy of the model whose projection weights include the LoRA: W + up @ down."""
    model = copy.deepcopy(lm.model)
    widths = BlockWidths.of(lm.config)
    for index, block in model.span.blocks.items():
        projections = {**dict(block.attn.named_children()), **dict(block.mlp.named_children())}
        for name, (down, up) in unpack_lora(adapter.prompts.detach()[int(index)], widths).items():
            projections[name].weight.data += up @ down
    return model


def test_the_packed_layout_is_exactly_lora_of_every_projection(local_lm):
    widths = BlockWidths.of(local_lm.config)
    assert all(widths.rank(widths.rows(rank)) == rank for rank in range(1, 40))
    assert widths.rank(widths.rows(3) + 1) is None and widths.rank(0) is None
    adapter = lora_for(local_lm, rank=3)
    hidden = local_lm.model.embedding(torch.randint(4, 200, (2, 9), generator=torch.Generator().manual_seed(1)))
    with torch.no_grad():
        applied = local_lm.model.span(hidden, adapter=BlockAdapter(LORA, adapter.prompts))
        merged = merged_model(local_lm, adapter).span(hidden)
        plain = local_lm.model.span(hidden)
    assert (applied - merged).abs().max().item() <= 1e-4
    assert (applied - plain).abs().max().item() > 1e-2
    fresh = LoRAAdapter.initialized(adapter.config, local_lm.model.embedding, local_lm.config.vocab_size,
                                    torch.Generator().manual_seed(0))
    for down, up in unpack_lora(fresh.prompts.detach()[0], widths).values():
        assert down.abs().max() > 0 and up.abs().max() == 0  # a new adapter is the identity
    with torch.no_grad():
        assert torch.equal(local_lm.model.span(hidden, adapter=BlockAdapter(LORA, fresh.prompts)), plain)


def test_lora_gradients_through_the_swarm_equal_local_autograd(remote_lm, local_lm, tmp_path):
    adapter = lora_for(local_lm)
    local_loss, local_grad = adapter_gradient(local_lm, tmp_path, adapter)
    swarm_loss, swarm_grad = adapter_gradient(remote_lm, tmp_path, adapter)
    assert len({hop.peer_id for hop in remote_lm.planner.route}) >= 2  # the weights are split between servers
    widths = BlockWidths.of(local_lm.config)
    for block in range(local_lm.config.num_layers):  # every projection of every block gets a gradient
        assert all(down.abs().max() > 1e-5 and up.abs().max() > 1e-5
                   for down, up in unpack_lora(local_grad[block], widths).values())
    assert swarm_loss == pytest.approx(local_loss, abs=1e-6)
    assert (swarm_grad - local_grad).abs().max().item() <= TOLERANCE


def test_a_lora_gives_the_same_tokens_locally_and_through_the_swarm(remote_lm, local_lm, tmp_path):
    path = str(lora_for(local_lm, rank=2, seed=5).save(tmp_path / "lora"))
    plain = local_lm.generate("adapt", **GENERATION).token_ids
    for options in ({}, {"cache": "dual", "cache_refresh": 2}, {"remasking": "random", "parallel_window": 2}):
        local = local_lm.generate("adapt", adapter=path, **GENERATION, **options)
        swarm = remote_lm.generate("adapt", adapter=path, **GENERATION, **options)
        assert swarm.token_ids == local.token_ids, options
    assert local_lm.generate("adapt", adapter=path, **GENERATION).token_ids != plain  # it changes the text


def test_servers_refuse_a_tensor_that_is_no_lora_and_go_on(remote_lm, local_lm):
    server = holder_of(remote_lm, 0, 2)
    hidden = torch.randn(1, 5, 32)
    rows = BlockWidths.of(local_lm.config).rows(1)
    parts = request_parts(ForwardRequest(0, 2, hidden, adapter=BlockAdapter(LORA, torch.randn(2, rows + 1, 32))))
    with pytest.raises(RemoteError, match=f"{rows + 1} rows per block are no LoRA of this model") as refused:
        raw_call(remote_lm, server, parts)
    assert refused.value.code == ErrorCode.BAD_REQUEST
    weights = 0.3 * torch.randn(2, rows, 32)
    adapter = BlockAdapter(LORA, weights)
    output, _ = raw_call(remote_lm, server, request_parts(ForwardRequest(0, 2, hidden, adapter=adapter)))
    with torch.no_grad():
        expected = local_lm.model.span(hidden, blocks=(0, 2), adapter=adapter)
    assert (output - expected).abs().max().item() <= TOLERANCE


def test_bad_lora_files_are_refused_with_a_clear_error(local_lm, tmp_path):
    good = lora_for(local_lm).save(tmp_path / "good")
    loaded = PromptAdapter.load(good)
    assert isinstance(loaded, LoRAAdapter) and loaded.length == 0 and loaded.config.shape == (4, 32, 32)
    base = json.loads((good / ADAPTER_CONFIG).read_text())["base"]
    cases = [
        ("positions", lambda d: _edit_json(d, prompt_length=4), "a lora adapter adds no positions"),
        ("widths", lambda d: _edit_json(d, base={k: v for k, v in base.items() if k != "intermediate_size"}),
         "a LoRA's base must record the model's intermediate_size"),
        ("rank", lambda d: _edit_json(d, rank=3), r"shape \(4, 32, 32\).*expected \(4, 48, 32\)"),
        ("mlp", lambda d: _edit_json(d, base=dict(base, intermediate_size=128)), "intermediate_size 128"),
    ]
    assert_files_refused(local_lm, loaded, tmp_path, cases)


def test_adapters_saved_before_the_base_recorded_widths_still_load(local_lm, tmp_path):
    """Bottlenecks and prompts do not depend on the MLP or head widths, so their older files stay usable."""
    saved = bottleneck_for(local_lm).save(tmp_path / "old")
    config = json.loads((saved / ADAPTER_CONFIG).read_text())
    _edit_json(saved, base={k: v for k, v in config["base"].items() if k not in LAYOUT_KEYS})
    loaded = PromptAdapter.load(saved, base_of(local_lm.config, local_lm.tokenizer))
    assert loaded.config.rank == 2


def test_finetune_command_trains_a_lora_through_the_swarm(local_swarm, tiny_model_path, tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", [("1+1=", "2"), ("5+3=", "8")])
    output = tmp_path / "adapter"
    peers = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
    run_finetune("--model", str(tiny_model_path), "--data", data, "--output", str(output), "--batch-size", "2",
                 "--adapter-kind", "lora", "--rank", "2", *peers, "--steps", "2", "--lr", "0.05", "--down-scale", "4")
    config = json.loads((output / ADAPTER_CONFIG).read_text())
    assert config["kind"] == "lora" and config["rank"] == 2 and config["prompt_length"] == 0
    assert config["training"]["through_swarm"] is True and config["training"]["steps"] == 2
    assert config["training"]["down_scale"] == 4
    trained = PromptAdapter.load(output)
    widths = BlockWidths.of(trained.config.base)
    for block in range(trained.config.num_blocks):  # every projection's up moved from zero
        assert all(up.abs().max() > 0 for _, up in unpack_lora(trained.prompts.detach()[block], widths).values())


def test_a_lora_declaration_is_checked_before_receiving():
    from swarm.server.validation import validate_prompt_declared

    widths = BlockWidths(32, 4, 2, 64)
    declared = {"prompt_length": widths.rows(4), "prompt_parts": 1, "prompt_kind": LORA}
    assert validate_prompt_declared(declared, 2, 10_000, widths) == (widths.rows(4), 1, LORA)
    with pytest.raises(RemoteError, match="are no LoRA of this model"):
        validate_prompt_declared(dict(declared, prompt_length=widths.rows(4) + 1), 2, 10_000, widths)
    with pytest.raises(RemoteError, match=f"integer in 1..{widths.rows(128)} for a lora"):
        validate_prompt_declared(dict(declared, prompt_length=widths.rows(129)), 2, 100_000, widths)
    with pytest.raises(RemoteError, match="exceeds this server's limit") as refused:
        validate_prompt_declared(declared, 4, widths.rows(4) * 4 - 1, widths)
    assert refused.value.code == ErrorCode.TOO_LARGE


def test_scaled_down_projections_are_lora_plus_under_adam(local_lm):
    """--down-scale c: the down projections start c times larger (the adapter still the identity), and Adam at lr
    moves the product ``up @ down`` as Adam with lr / c on the down projections and c * lr on the up ones (LoRA+'s
    ratio c**2) from the unscaled start: the doc's claim, checked on a least-squares problem."""
    from swarm.adapters.adapter import new_adapter

    base = base_of(local_lm.config, local_lm.tokenizer)
    plain, scaled = (new_adapter(LORA, 2, local_lm.config, base, local_lm.model.embedding,
                                 torch.Generator().manual_seed(0), head_rank=3, down_scale=scale)
                     for scale in (1.0, 4.0))
    widths = BlockWidths.of(local_lm.config)
    for (down, up), (scaled_down, scaled_up) in zip(unpack_lora(plain.prompts.detach()[1], widths).values(),
                                                    unpack_lora(scaled.prompts.detach()[1], widths).values()):
        assert torch.allclose(scaled_down, 4 * down) and down.abs().max() > 0 and scaled_up.abs().max() == 0
    assert torch.allclose(scaled.head_down, 4 * plain.head_down) and scaled.head_up.abs().max() == 0

    generator = torch.Generator().manual_seed(2)
    inputs, targets = torch.randn(64, 12, generator=generator), torch.randn(64, 10, generator=generator)
    start = torch.randn(3, 12, generator=generator) / 12 ** 0.5

    def trained_product(down_scale: float, down_lr: float, up_lr: float) -> torch.Tensor:
        down = torch.nn.Parameter(down_scale * start.clone())
        up = torch.nn.Parameter(torch.zeros(10, 3))
        adam = torch.optim.Adam([{"params": [down], "lr": down_lr}, {"params": [up], "lr": up_lr}], eps=1e-12)
        for _ in range(20):
            adam.zero_grad()
            ((inputs @ down.T @ up.T - targets) ** 2).mean().backward()
            adam.step()
        return (up @ down).detach()

    lr, c = 0.01, 4.0
    assert torch.allclose(trained_product(c, lr, lr), trained_product(1.0, lr / c, c * lr), atol=1e-5)
    assert not torch.allclose(trained_product(c, lr, lr), trained_product(1.0, lr, lr), atol=1e-3)


def test_a_lora_run_takes_its_kind_s_defaults_and_a_resumed_run_keeps_its_own(local_lm, tmp_path):
    """--down-scale and --max-grad-norm default to 4 and 1 for a LoRA (finding 4), to 1 and 0 for other kinds; a
    resumed run left without them keeps what it was started with (also a run saved before they existed)."""
    data = write_pairs(tmp_path / "pairs.jsonl", [("1+1=", "2"), ("5+3=", "8")])

    def config(output: str, kind: str = LORA, steps: int = 1, **settings) -> FinetuneConfig:
        return FinetuneConfig(data, str(tmp_path / output), steps=steps, lr=0.01, batch_size=2, adapter_kind=kind,
                              rank=2, prompt_length=2, **settings)

    lora = config("lora")
    Finetuner(local_lm, lora).run(progress=False)
    assert (lora.down_scale, lora.max_grad_norm) == (4.0, 1.0)
    training = json.loads((tmp_path / "lora" / ADAPTER_CONFIG).read_text())["training"]
    assert (training["down_scale"], training["max_grad_norm"]) == (4.0, 1.0)
    for kind in (BOTTLENECK, "deep_prompt"):
        other = config(kind, kind)
        Finetuner(local_lm, other)
        assert (other.down_scale, other.max_grad_norm) == (1.0, 0.0), kind

    Finetuner(local_lm, config("plain", down_scale=1.0, max_grad_norm=0.0)).run(progress=False)
    resumed = config("plain", steps=2)
    Finetuner(local_lm, resumed).run(progress=False)
    assert (resumed.down_scale, resumed.max_grad_norm) == (1.0, 0.0)
    with pytest.raises(ValueError, match=r"down_scale: 1\.0 -> 4\.0"):
        Finetuner(local_lm, config("plain", steps=3, down_scale=4.0))

    state_path = tmp_path / "lora" / STATE_FILE  # as a run saved before the settings existed: it ran without them
    state = torch.load(state_path, weights_only=False)
    for name in ("down_scale", "max_grad_norm"):
        del state["config"][name]
    torch.save(state, state_path)
    older = config("lora", steps=2)
    Finetuner(local_lm, older)
    assert (older.down_scale, older.max_grad_norm) == (1.0, 0.0)
