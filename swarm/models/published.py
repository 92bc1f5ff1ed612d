"""LLaDA's and Dream's published checkpoint layouts, restated by hand: ``config.json`` and tensor names and shapes.

These are the published files' facts (``GSAI-ML/LLaDA-8B-Instruct``, ``Dream-org/Dream-v0-Instruct-7B``), written
out independently of :mod:`swarm.models.formats`: the tests build checkpoints from them and check that ``formats``
reads them as the published modeling files compute them, so nothing here is derived from the mapping under test.
Benchmarks build checkpoints of the published layout at real widths from the same definitions.

* :data:`LLADA_CONFIG` and :data:`DREAM_CONFIG`: the published ``config.json`` keys and fixed values, at tiny
  widths (quick to build and run); :data:`LLADA_8B_WIDTHS` holds the widths of LLaDA-8B-Instruct to put over them.
* :func:`llada_shapes` and :func:`dream_shapes`: every tensor name the published checkpoint stores for a config,
  with its shape.
"""
from __future__ import annotations

# ----- published configs (tiny sizes; keys and fixed values as in GSAI-ML/LLaDA-8B-Instruct, Dream-v0-7B) ------
LLADA_CONFIG = {
    "architectures": ["LLaDAModelLM"],
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
                 "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
    "model_type": "llada", "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "attention_dropout": 0.0,
    "attention_layer_norm": False, "attention_layer_norm_with_affine": True, "bias_for_layer_norm": False,
    "block_group_size": 1, "block_type": "llama", "d_model": 32, "embedding_dropout": 0.0, "embedding_size": 64,
    "eos_token_id": 40, "flash_attention": False, "include_bias": False, "include_qkv_bias": False,
    "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02,
    "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": 45,
    "max_sequence_length": 128, "mlp_hidden_size": 48, "mlp_ratio": 4, "multi_query_attention": None,
    "n_heads": 4, "n_kv_heads": 4, "n_layers": 3, "pad_token_id": 40, "precision": "amp_bf16",
    "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True,
    "rope_theta": 500000.0, "scale_logits": False, "use_cache": False, "vocab_size": 60, "weight_tying": False,
}
# LLaDA-8B-Instruct's published widths and special ids: dict(LLADA_CONFIG, **LLADA_8B_WIDTHS) has its real sizes.
LLADA_8B_WIDTHS = {"d_model": 4096, "n_heads": 32, "n_kv_heads": 32, "mlp_hidden_size": 12288, "vocab_size": 126464,
                   "embedding_size": 126464, "mask_token_id": 126336, "eos_token_id": 126081, "pad_token_id": 126081}

DREAM_CONFIG = {
    "architectures": ["DreamModel"],
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "model_type": "Dream", "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None, "hidden_act": "silu",
    "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 48, "mask_token_id": None,
    "max_position_embeddings": 128, "max_window_layers": 2, "num_attention_heads": 4, "num_hidden_layers": 3,
    "num_key_value_heads": 2, "pad_token_id": None, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": 128, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 320,
}


# ----- published tensor names and shapes -----------------------------------------------------------------------
def llada_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of ``LLaDAModelLM`` with ``LLaDALlamaBlock`` blocks."""
    d, hd, ff, rows = cfg["d_model"], cfg["d_model"] // cfg["n_heads"], cfg["mlp_hidden_size"], cfg["embedding_size"]
    kv = cfg["n_kv_heads"] * hd
    shapes = {"model.transformer.wte.weight": (rows, d), "model.transformer.ln_f.weight": (d,),
              "model.transformer.ff_out.weight": (rows, d)}
    for i in range(cfg["n_layers"]):
        b = f"model.transformer.blocks.{i}."
        shapes.update({b + "attn_norm.weight": (d,), b + "q_proj.weight": (d, d), b + "k_proj.weight": (kv, d),
                       b + "v_proj.weight": (kv, d), b + "attn_out.weight": (d, d), b + "ff_norm.weight": (d,),
                       b + "ff_proj.weight": (ff, d), b + "up_proj.weight": (ff, d), b + "ff_out.weight": (d, ff)})
    return shapes


def dream_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of ``DreamModel`` (Qwen2 layout, q/k/v with bias)."""
    d, ff, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * d // cfg["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    for i in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{i}."
        shapes.update({
            b + "input_layernorm.weight": (d,), b + "post_attention_layernorm.weight": (d,),
            b + "self_attn.q_proj.weight": (d, d), b + "self_attn.q_proj.bias": (d,),
            b + "self_attn.k_proj.weight": (kv, d), b + "self_attn.k_proj.bias": (kv,),
            b + "self_attn.v_proj.weight": (kv, d), b + "self_attn.v_proj.bias": (kv,),
            b + "self_attn.o_proj.weight": (d, d),
            b + "mlp.gate_proj.weight": (ff, d), b + "mlp.up_proj.weight": (ff, d), b + "mlp.down_proj.weight": (d, ff),
        })
    return shapes
