"""The model pieces: spans equal the full model, partial reads, bidirectional attention, reference math."""
from __future__ import annotations

import math

import pytest
import torch

from swarm.models.checkpoint import CheckpointReader, save_checkpoint
from swarm.models.layers import TransformerBlock, rotary_cos_sin
from swarm.models.loading import ModelFiles
from swarm.models.modules import BlockSpan, DiffusionTransformer, align_logits
from tests.conftest import make_checkpoint, tiny_config


def test_span_output_equals_same_blocks_in_full_model(tiny_model_path):
    files = ModelFiles(tiny_model_path)
    full = files.full_model()
    ids = torch.randint(0, 256, (2, 11))
    hidden = full.embedding(ids)
    expected = full.span(hidden)
    first, second = files.span(0, 2), files.span(2, 4)
    assert sorted(first.blocks) == ["0", "1"] and sorted(second.blocks) == ["2", "3"]
    torch.testing.assert_close(second(first(hidden)), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full.head(second(first(hidden))), full(ids), rtol=1e-5, atol=1e-5)


def test_partial_read_equals_slice_and_opens_only_needed_shards(tiny_model_path, sharded_model_path):
    whole = CheckpointReader(tiny_model_path)
    reader = CheckpointReader(sharded_model_path)
    files = ModelFiles(sharded_model_path)
    files.reader = reader
    span = files.span(3, 4)
    names = list(span.state_dict())
    assert all(n.startswith("blocks.3.") for n in names)
    expected = whole.read(names)
    for name, tensor in span.state_dict().items():
        torch.testing.assert_close(tensor, expected[name])
    all_files = set(reader.weight_map.values())
    assert len(all_files) > 2, "the fixture should be sharded into several files"
    assert reader.files_opened == {reader.weight_map[n] for n in names}
    assert reader.files_opened < all_files


def test_attention_is_bidirectional(tiny_model_path):
    model = ModelFiles(tiny_model_path).full_model()
    ids = torch.randint(0, 256, (1, 10))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 256
    before, after = model(ids), model(changed)
    assert not torch.allclose(before[0, 0], after[0, 0]), "position 0 must see the last token"


def test_padding_mask_hides_padded_keys(tiny_model_path):
    model = ModelFiles(tiny_model_path).full_model()
    ids = torch.randint(0, 256, (1, 8))
    padded = torch.cat([ids, torch.randint(0, 256, (1, 3))], dim=1)
    mask = torch.tensor([[True] * 8 + [False] * 3])
    torch.testing.assert_close(model(padded, mask)[:, :8], model(ids), rtol=1e-5, atol=1e-5)


def reference_block(block: TransformerBlock, x: torch.Tensor, theta: float) -> torch.Tensor:
    """A plain, loop-based restatement of the block: RMSNorm, RoPE, GQA with biases, SwiGLU."""
    cfg = block.config
    length = x.shape[1]

    def rms(v, w):
        return w * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def rope(v):  # v: (length, head_dim); rotate pairs (i, i + half) by angle pos * theta^(-2i/d)
        half = cfg.head_dim // 2
        out = torch.empty_like(v)
        for pos in range(length):
            for i in range(half):
                angle = pos * theta ** (-2 * i / cfg.head_dim)
                a, b = v[pos, i], v[pos, i + half]
                out[pos, i] = a * math.cos(angle) - b * math.sin(angle)
                out[pos, i + half] = b * math.cos(angle) + a * math.sin(angle)
        return out

    att = block.attn
    h = rms(x[0], block.attn_norm.weight)
    q = h @ att.q_proj.weight.T + (att.q_proj.bias if att.q_proj.bias is not None else 0)
    k = h @ att.k_proj.weight.T + (att.k_proj.bias if att.k_proj.bias is not None else 0)
    v = h @ att.v_proj.weight.T + (att.v_proj.bias if att.v_proj.bias is not None else 0)
    heads = []
    group = cfg.num_heads // cfg.num_kv_heads
    for head in range(cfg.num_heads):
        kv = head // group
        qh = rope(q[:, head * cfg.head_dim:(head + 1) * cfg.head_dim])
        kh = rope(k[:, kv * cfg.head_dim:(kv + 1) * cfg.head_dim])
        vh = v[:, kv * cfg.head_dim:(kv + 1) * cfg.head_dim]
        weights = torch.softmax(qh @ kh.T / math.sqrt(cfg.head_dim), dim=-1)
        heads.append(weights @ vh)
    x1 = x[0] + torch.cat(heads, dim=-1) @ att.o_proj.weight.T
    h2 = rms(x1, block.mlp_norm.weight)
    mlp = block.mlp
    gate = h2 @ mlp.gate_proj.weight.T
    out = x1 + (gate * torch.sigmoid(gate) * (h2 @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return out[None]


@pytest.mark.parametrize("qkv_bias,kv_heads,theta", [(False, 4, 10000.0), (True, 2, 500000.0), (True, 1, 1e6)])
def test_block_matches_plain_reference(qkv_bias, kv_heads, theta):
    torch.manual_seed(1)
    config = tiny_config(qkv_bias=qkv_bias, num_kv_heads=kv_heads, rope_theta=theta)
    block = TransformerBlock(config).double()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(1, 7, config.hidden_size, dtype=torch.float64)
    positions = torch.arange(7)[None]
    cos, sin = rotary_cos_sin(positions, config.head_dim, theta, torch.float64)
    torch.testing.assert_close(block(x, cos, sin), reference_block(block, x, theta))


def test_span_outside_model_is_rejected():
    with pytest.raises(ValueError, match="not inside"):
        BlockSpan(tiny_config(), 2, 9)


def test_logits_shift_aligns_position_i_with_token_i():
    config = tiny_config(logits_shift=True)
    logits = torch.arange(12.0).view(1, 4, 3)
    shifted = align_logits(logits, config)
    torch.testing.assert_close(shifted[0, 1:], logits[0, :-1])
    torch.testing.assert_close(shifted[0, 0], logits[0, 0])


def test_tied_embeddings_are_read_for_the_head(tmp_path):
    config = tiny_config(tie_word_embeddings=True)
    torch.manual_seed(0)
    model = DiffusionTransformer(config)
    save_checkpoint(tmp_path, config, model.native_state_dict())
    assert "lm_head.weight" not in CheckpointReader(tmp_path).weight_map
    head = ModelFiles(tmp_path).head()
    torch.testing.assert_close(head.lm_head.weight, model.embedding.embed.weight)


def test_half_precision_checkpoint_loads_in_requested_dtype(tmp_path):
    make_checkpoint(tmp_path, tiny_config())
    files = ModelFiles(tmp_path)
    assert files.span(0, 1, dtype="bfloat16").blocks["0"].attn.q_proj.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        files.span(0, 1, dtype="int8")
