"""Peak memory of loading one block span from a sharded checkpoint in LLaDA's published layout.

Builds a checkpoint of a few hundred MB (LLaDA key names and config keys, bfloat16, sharded with
``model.safetensors.index.json``) in a temporary directory, then loads each part in a fresh subprocess and
reads the process's peak resident memory (``ru_maxrss``) and its resident memory once loading is done.
What a server needs is the peak; the table shows it scales with the span, not with the checkpoint.

It also measures the error of int8 weight-only quantization against the float32 span, and prints the
sizes the real LLaDA-8B and Dream-7B imply, computed from their published configs.

    python benchmarks/span_memory.py                # build, measure, print the tables
    python benchmarks/span_memory.py --keep DIR     # keep the built checkpoint in DIR
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from swarm.benchmark.client_memory import process_memory
from swarm.models.checkpoint import save_tensors
from swarm.models.config import ModelConfig
from swarm.models.formats import LLADA_LAYOUT, dream_config, llada_config
from swarm.models.modules import BlockSpan, DiffusionTransformer, OutputHead, TokenEmbedding

MiB = 2**20

# A LLaDA-shaped model scaled down: head_dim 128 and the MLP ratio of LLaDA-8B, 12 blocks of 25.7 MB in bf16.
BENCH_CONFIG = {
    "architectures": ["LLaDAModelLM"], "model_type": "llada", "block_type": "llama", "activation_type": "silu",
    "layer_norm_type": "rms", "include_bias": False, "include_qkv_bias": False, "weight_tying": False,
    "d_model": 1024, "n_heads": 8, "n_kv_heads": 8, "n_layers": 12, "mlp_hidden_size": 2816,
    "vocab_size": 16384, "embedding_size": 16384, "mask_token_id": 16383, "eos_token_id": 16382,
    "pad_token_id": 16382, "max_sequence_length": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
}
SHARD_BYTES = 100 * MiB

# Published sizes (GSAI-ML/LLaDA-8B-Instruct and Dream-org/Dream-v0-Instruct-7B config.json).
LLADA_8B = dict(BENCH_CONFIG, d_model=4096, n_heads=32, n_kv_heads=32, n_layers=32, mlp_hidden_size=12288,
                vocab_size=126464, embedding_size=126464, mask_token_id=126336, eos_token_id=126081,
                pad_token_id=126081)
DREAM_7B = {"architectures": ["DreamModel"], "model_type": "Dream", "hidden_size": 3584, "intermediate_size": 18944,
            "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
            "mask_token_id": 151666, "eos_token_id": 151643, "pad_token_id": 151643, "bos_token_id": 151643}


def build_checkpoint(directory: Path) -> Path:
    """Random bfloat16 weights under LLaDA's names; shapes come from our modules built on the meta device."""
    config = llada_config(BENCH_CONFIG, directory)
    with torch.device("meta"):
        model = DiffusionTransformer(config)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, meta in model.native_state_dict().items():
        values = torch.ones(meta.shape) if meta.dim() == 1 else torch.randn(meta.shape, generator=gen) * 0.02
        tensors[LLADA_LAYOUT(name)] = values.to(torch.bfloat16)
    (directory / "config.json").write_text(json.dumps(BENCH_CONFIG, indent=2))
    save_tensors(directory, tensors, max_shard_bytes=SHARD_BYTES)
    return directory


def measure_child(directory: Path, part: str, start: int, end: int, dtype: str, int8: bool) -> dict:
    """Runs in a fresh process: load one part, run one forward pass, report bytes and memory."""
    from swarm.models.loading import ModelFiles
    from swarm.models.quantization import quantize_span_int8

    files = ModelFiles(directory)
    with torch.device("meta"):  # first-use costs of torch (lazy imports, ~75 MiB) are not the checkpoint's
        DiffusionTransformer(files.config.replace(num_layers=1))
    before = process_memory()
    started = time.perf_counter()
    if part == "span":
        span = files.span(start, end, dtype)
        modules = [quantize_span_int8(span) if int8 else span]
    else:  # what a client holds
        modules = [files.embedding(dtype), files.head(dtype)]
    elapsed = time.perf_counter() - started
    loaded = process_memory()
    ids = torch.randint(0, 1000, (1, 16))
    with torch.inference_mode():  # touches every weight once, as a server's first request does
        if part == "span":
            modules[0](modules[0].blocks[str(start)].attn_norm.weight.new_zeros(1, 16, files.config.hidden_size) + 1)
        else:
            modules[1](modules[0](ids))
    served = process_memory()
    tensors = [t for m in modules for t in list(m.parameters()) + list(m.buffers())]
    return {
        "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "load_peak": loaded["peak"] - before["rss"],
        "loaded": loaded["rss"] - before["rss"],
        "served": served["rss"] - before["rss"],
        "served_file": served["file"] - before["file"],
        "shards": f"{len(files.reader.files_opened)}/{len(set(files.reader.weight_map.values()))}",
        "load_s": elapsed,
    }


def run_case(directory: Path, part: str, start: int, end: int, dtype: str, int8: bool = False) -> dict:
    command = [sys.executable, __file__, "--child", str(directory), part, str(start), str(end), dtype, str(int(int8))]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def int8_error(directory: Path, start: int, end: int) -> dict:
    """Relative error of the int8 span (quantized from the bf16 load) and of a bf16 span, against float32."""
    from swarm.models.loading import ModelFiles
    from swarm.models.quantization import quantize_span_int8

    files = ModelFiles(directory)
    hidden = files.embedding("float32")(torch.randint(0, 16000, (1, 256), generator=torch.Generator().manual_seed(1)))
    with torch.inference_mode():
        exact = files.span(start, end, "float32")(hidden)
        half = files.span(start, end, "bfloat16")(hidden.bfloat16()).float()
        int8 = quantize_span_int8(files.span(start, end, "bfloat16")).float()(hidden)

    def relative(approx: torch.Tensor) -> float:
        return ((approx - exact).norm() / (exact - hidden).norm()).item()

    return {"bf16": relative(half), "int8": relative(int8)}


def published_sizes() -> list[tuple[str, ModelConfig]]:
    return [("LLaDA-8B", llada_config(LLADA_8B)), ("Dream-7B", dream_config(DREAM_7B))]


def parameter_count(config: ModelConfig, build) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build(config).parameters())


def print_published_sizes() -> None:
    print("\nSizes implied by the published configs (parameters counted on the meta device):")
    print(f"{'model':10} {'block params':>13} {'block bf16':>11} {'block int8':>11} {'all blocks bf16':>16} "
          f"{'emb+head bf16':>14} {'hidden/token fp16':>18}")
    for name, config in published_sizes():
        block = parameter_count(config, lambda c: BlockSpan(c, 0, 1))
        client = parameter_count(config, TokenEmbedding) + parameter_count(config, OutputHead)
        print(f"{name:10} {block / 1e6:>12.1f}M {2 * block / 2**30:>10.2f}G {block / 2**30:>10.2f}G "
              f"{2 * block * config.num_layers / 2**30:>15.2f}G {2 * client / 2**30:>13.2f}G "
              f"{2 * config.hidden_size / 1024:>16.1f}KiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", type=Path, help="build the checkpoint here and keep it")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        directory, part, start, end, dtype, int8 = args.child
        print(json.dumps(measure_child(Path(directory), part, int(start), int(end), dtype, int8 == "1")))
        return

    with tempfile.TemporaryDirectory() as scratch:
        directory = args.keep or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        build_checkpoint(directory)
        total = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        shards = len(list(directory.glob("*.safetensors")))
        print(f"checkpoint: {total / MiB:.0f} MiB in LLaDA layout, {shards} shards, "
              f"12 blocks of d_model 1024 / MLP 2816, vocab 16384")
        cases = [("span", 0, 1, "bfloat16", False), ("span", 0, 3, "bfloat16", False),
                 ("span", 0, 6, "bfloat16", False), ("span", 6, 12, "bfloat16", False),
                 ("span", 0, 12, "bfloat16", False), ("span", 0, 6, "float32", False),
                 ("span", 0, 6, "bfloat16", True), ("client", 0, 0, "bfloat16", False)]
        print("\nMiB above the process's baseline (imports done, config read); 'served' = after one forward pass,")
        print("of which 'file' are mmapped checkpoint pages (page cache, shared by processes reading the same files).")
        print(f"\n{'part':16} {'dtype':13} {'tensors':>8} {'load peak':>9} {'loaded':>7} {'served':>7} {'(file)':>7} "
              f"{'served/tensors':>14} {'shards':>6} {'load s':>6}")
        for part, start, end, dtype, int8 in cases:
            r = run_case(directory, part, start, end, dtype, int8)
            label = f"blocks {start}:{end}" if part == "span" else "embedding+head"
            print(f"{label:16} {dtype + (' > int8' if int8 else ''):13} {r['tensor_bytes'] / MiB:>8.1f} "
                  f"{r['load_peak'] / MiB:>9.1f} {r['loaded'] / MiB:>7.1f} {r['served'] / MiB:>7.1f} "
                  f"{r['served_file'] / MiB:>7.1f} {r['served'] / r['tensor_bytes']:>14.2f} {r['shards']:>6} "
                  f"{r['load_s']:>6.2f}")
        errors = int8_error(directory, 0, 12)
        print(f"\nerror of blocks 0:12 against float32, relative to the blocks' update of the residual stream: "
              f"bf16 {errors['bf16']:.4f}, int8 (from bf16) {errors['int8']:.4f}")
    print_published_sizes()


if __name__ == "__main__":
    main()
