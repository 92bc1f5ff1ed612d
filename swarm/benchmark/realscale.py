"""``python -m swarm.benchmark realscale``: the per-step costs at LLaDA-8B's real widths (issue 17).

Builds (or takes with ``--model``) a LLaDA-layout checkpoint with LLaDA-8B's widths (hidden 4096, 32 heads,
SwiGLU 12288, vocabulary 126464, bfloat16) and ``--blocks`` blocks of random weights in a temporary folder
(deleted after), starts servers of ``--span`` blocks (default 1), and prints per denoising step, side by
side: the client's milliseconds (embedding, head, sampler and the rest), the servers' compute milliseconds,
the bytes of one crossing each way, the client's resident memory and tokens/s, for the old defaults (float32
client and wire, head over every row) against the new ones (bfloat16 client and wire, the head on the last
server, started with ``--head``, or over the active block in the client); then the servers' resident memory
and a projection for 32 blocks on GPU servers, with its assumptions. torch and the models are imported in the
functions that use them, so that ``--help`` answers at once.
"""
from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import click
import psutil

from swarm.cli.options import gen_length_option
from swarm.utils.local_swarm import LocalSwarm

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# LLaDA-8B-Instruct's published config, with its real widths; n_layers is set per run.
LLADA_8B = {
    "architectures": ["LLaDAModelLM"], "model_type": "llada", "activation_type": "silu", "alibi": False,
    "attention_layer_norm": False, "block_type": "llama", "d_model": 4096, "embedding_size": 126464,
    "eos_token_id": 126081, "flash_attention": False, "include_bias": False, "include_qkv_bias": False,
    "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": 126336,
    "max_sequence_length": 4096, "mlp_hidden_size": 12288, "multi_query_attention": None, "n_heads": 32,
    "n_kv_heads": 32, "n_layers": 32, "pad_token_id": 126081, "rms_norm_eps": 1e-05, "rope": True,
    "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False, "vocab_size": 126464,
    "weight_tying": False, "torch_dtype": "bfloat16",
}
SPECIALS = {"<|startoftext|>": 126080, "<|endoftext|>": 126081, "<|mdm_mask|>": 126336}
WORDS = "the a cat dog sat on mat ran far hello world once upon time".split()


@dataclass(frozen=True)
class Setting:
    """One client configuration measured."""

    label: str
    wire_dtype: str  # client requests and servers' answers
    head_rows: str
    client_dtype: Optional[str] = None  # None: the checkpoint's (bfloat16)
    head: str = "client"  # ClientConfig.head: "auto" lets the last server (started with --head) answer predictions
    generation: tuple[tuple[str, Any], ...] = ()  # what this setting adds to generate's arguments
    lora_rank: int = 0  # above 0: a random LoRA adapter of this rank on every projection of every block

    @property
    def uses_expert(self) -> bool:
        return any(name == "experts" for name, _ in self.generation)


EXPERT_DOMAIN = "wide"  # the expert rows' model: the same 8B-width checkpoint, hosted whole by its own server
# The bfloat16-wire group runs first, the head on the swarm first of all: the process's resident memory then
# shows what that client holds (the embedding only), before other settings' heads have been loaded.
SETTINGS = (Setting("new default: head on the swarm (--head)", "auto", "active", head="auto"),
            Setting("dual cache, head on the swarm", "auto", "active", head="auto", generation=(("cache", "dual"),)),
            Setting("staleness 3, token checks, head on the swarm", "auto", "active", head="auto",
                    generation=(("staleness", 3), ("temperature", 0.7))),
            Setting("LoRA rank 8, head on the swarm", "auto", "active", head="auto", lora_rank=8),
            Setting("bf16 client+wire, head active block", "auto", "active"),
            Setting("bf16 client+wire, head all rows", "auto", "all"),
            Setting("old: fp32 client+wire, head all rows", "float32", "all", "float32"),
            Setting("bf16 client, fp32 wire, head all rows", "float32", "all"),
            Setting("expert top 64 (default)", "auto", "active", head="auto",
                    generation=(("experts", {EXPERT_DOMAIN: 1.0}), ("expert_top_k", 64))),
            Setting("expert, whole vocabulary", "auto", "active", head="auto",
                    generation=(("experts", {EXPERT_DOMAIN: 1.0}), ("expert_top_k", 0))))


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer with LLaDA's special ids (the benchmark prompts with token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{word: i + 1 for i, word in enumerate(WORDS)}, **SPECIALS}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(list(SPECIALS))
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                            pad_token="<|endoftext|>", unk_token="<unk>",
                            mask_token="<|mdm_mask|>").save_pretrained(str(directory))


def build_checkpoint(directory: Path, blocks: int, seed: int = 0) -> Path:
    """LLaDA-8B's widths with ``blocks`` blocks of random bfloat16 weights, in LLaDA's published layout."""
    import torch

    from swarm.models.checkpoint import load_config, save_tensors
    from swarm.models.formats import LLADA_LAYOUT
    from swarm.models.modules import DiffusionTransformer

    config = dict(LLADA_8B, n_layers=blocks)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(directory)
    native = load_config(directory)  # the same conversion every loader applies
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in DiffusionTransformer(native).native_state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    drawn: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}  # one draw per tensor kind, copied to each block
    tensors = {}
    for name, shape in shapes.items():
        kind = (name.split(".")[-2], shape)
        if kind in drawn:  # a copy: safetensors writes no two names over one storage
            tensors[LLADA_LAYOUT(name)] = drawn[kind].clone()
            continue
        # norms 1; matrices std 0.02 (LLaDA's init): hidden states of a realistic size
        drawn[kind] = tensors[LLADA_LAYOUT(name)] = (
            torch.ones(shape, dtype=torch.bfloat16) if name.endswith("norm.weight")
            else normal_bfloat16(shape, 0.02, generator))
    save_tensors(directory, tensors, max_shard_bytes=2 * 2**30)
    return directory


DRAW_CHUNK = 2**20  # numbers drawn in float32 at a time (a multiple of 16: see normal_bfloat16)


def normal_bfloat16(shape: tuple[int, ...], std: float, generator: "torch.Generator",
                    chunk: int = DRAW_CHUNK) -> "torch.Tensor":
    """``torch.empty(shape).normal_(0, std, generator=generator).to(torch.bfloat16)``, bit for bit (so the weights
    the tests' figures were found with), drawn ``chunk`` float32 numbers at a time into the bfloat16 tensor: the
    whole float32 draw (4 bytes a number, 1.25 billion numbers at LLaDA-8B's widths) cost the kernel its page
    faults, a third of the draw's CPU. The same numbers because torch's CPU ``normal_`` draws its uniforms in order
    and transforms them 16 at a time, so chunks of a multiple of 16 split nothing (tests/test_real_size.py)."""
    import torch

    out = torch.empty(shape, dtype=torch.bfloat16)
    flat, buffer = out.view(-1), torch.empty(min(chunk, out.numel()))
    for start in range(0, flat.numel(), chunk):
        part = buffer[:min(chunk, flat.numel() - start)]
        flat[start:start + part.numel()].copy_(part.normal_(0, std, generator=generator))
    return out


@contextlib.contextmanager
def checkpoint(model: Optional[str], blocks: int) -> Iterator[Path]:
    if model:
        yield Path(model)
        return
    directory = Path(tempfile.mkdtemp(prefix="realscale-"))
    try:
        click.echo(f"writing a LLaDA-8B-width checkpoint with {blocks} blocks to {directory} ...", err=True)
        yield build_checkpoint(directory, blocks)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def rss_mb(pid: Optional[int] = None) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


@dataclass
class StepFigures:
    label: str
    steps: int
    client_ms: dict[str, float]
    server_ms: float
    request_bytes: float
    answer_bytes: float
    tokens: list[int]
    client_rss_mb: float
    tokens_per_s: float
    client_weights_mb: float = 0.0  # the embedding's and (when loaded) the head's parameters
    head_on_swarm: bool = False
    expert_bytes: float = 0.0  # expert answers received per step
    client_cpu_ms: float = 0.0  # the client process's CPU time per step, every thread (not its DHT process's)


def weights_mb(*modules) -> float:
    return sum(p.numel() * p.element_size() for m in modules if m is not None for p in m.parameters()) / 2**20


def measure(lm, swarm_servers, prompt: list[int], settings: dict, label: str) -> StepFigures:
    """One generation with ``lm``; per-step averages of every figure."""
    lm.generate(prompt, **dict(settings, gen_length=settings["block_length"], steps=2))  # warm-up and route
    compute_before = server_compute_seconds(lm, swarm_servers)
    caller = lm.caller
    sent, received, calls = caller.bytes_sent, caller.bytes_received, caller.calls
    expert_received = caller.expert_bytes_received
    lm.timings.reset()
    started, cpu_started = time.perf_counter(), time.process_time()
    result = lm.generate(prompt, **settings)
    total, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    steps = max(1, lm.timings.calls)
    phases = {name: 1000 * seconds / steps for name, seconds in lm.timings.seconds.items()}
    server_ms = 1000 * (server_compute_seconds(lm, swarm_servers) - compute_before) / steps
    client = {"embedding": phases.get("embedding", 0.0), "head": phases.get("head", 0.0),
              "sampler+rest": 1000 * total / steps - sum(phases.values()), "wait": phases.get("swarm", 0.0)}
    crossings = max(1, caller.calls - calls)
    return StepFigures(label, steps, client, server_ms, (caller.bytes_sent - sent) / crossings,
                       (caller.bytes_received - received) / crossings, list(result.token_ids), rss_mb(),
                       len(result.token_ids) / total, weights_mb(lm.embedding, lm._head), lm._head is None,
                       (caller.expert_bytes_received - expert_received) / steps, 1000 * cpu / steps)


def server_compute_seconds(lm, servers) -> float:
    total = 0.0
    for server in servers:
        info, _ = lm.loop.run(lm.caller.info(server.peer_id, 10.0))
        total += float(info.get("compute_seconds", 0.0))
    return total


def print_table(figures: list[StepFigures], server_rss: list[float]) -> None:
    click.echo(f"\n{'setting (per step)':<40}{'embed ms':>9}{'head ms':>9}{'sampler ms':>11}{'wait ms':>9}"
               f"{'server ms':>10}{'client CPU ms':>14}{'req B/hop':>12}{'ans B/hop':>12}{'expert B':>11}"
               f"{'weights MiB':>12}{'RSS MiB':>9}"
               f"{'tok/s':>8}")
    for f in figures:
        c = f.client_ms
        # Calls in flight together (staleness) overlap their waits: the wall-time split then has no sampler share
        sampler = f"{c['sampler+rest']:>11.1f}" if c["sampler+rest"] >= 0 else f"{'overlap':>11}"
        click.echo(f"{f.label:<40}{c['embedding']:>9.1f}{c['head']:>9.1f}{sampler}"
                   f"{c['wait']:>9.1f}{f.server_ms:>10.1f}{f.client_cpu_ms:>14.1f}{f.request_bytes:>12,.0f}{f.answer_bytes:>12,.0f}"
                   f"{f.expert_bytes:>11,.0f}{f.client_weights_mb:>12,.0f}{f.client_rss_mb:>9,.0f}"
                   f"{f.tokens_per_s:>8.2f}")
    click.echo(f"\nserver RSS: {', '.join(f'{m:,.0f}' for m in server_rss)} MiB; client RSS is the "
               "benchmark process's (earlier settings' freed memory may still count)")


def print_projection(figures: list[StepFigures], rows: int, blocks: int) -> None:
    block_gflop = 2 * rows * (4 * 4096 * 4096 + 3 * 4096 * 12288) / 1e9
    click.echo(
        f"\nProjection, 32 blocks on GPU servers (assumptions: each block {block_gflop:.1f} GFLOP for {rows} rows, "
        "computed at ~1 ms on a datacenter GPU (bfloat16, memory-bound: 0.44 GB of weights at ~2 TB/s = 0.2 ms, "
        "plus launch overheads); the head on the last GPU server ~1 ms more (1 GB of bfloat16 weights); "
        "4 servers of 8 blocks; 20 ms one-way network latency; client on this CPU):")
    crossing_ms = 2 * 20
    for f in figures:
        servers_ms = 32 * 1.0 + 4 * crossing_ms + (1.0 if f.head_on_swarm else 0.0)
        client_ms = f.client_cpu_ms  # the client's own work, whatever overlaps
        step = client_ms + servers_ms
        click.echo(f"  {f.label:<44} client {client_ms:>7.0f} ms + swarm {servers_ms:.0f} ms = {step:>6.0f} ms/step")
    click.echo(f"  (client figures measured here with {blocks} blocks; they do not depend on the number of blocks)")


def swarm_options(command):
    """The checkpoint and server options of the benchmarks at LLaDA-8B's widths (this one and adapter-wire)."""
    options = [
        click.option("--model", default=None, help="A LLaDA-layout checkpoint to use instead of building one."),
        click.option("--blocks", type=click.IntRange(min=1), default=2, show_default=True,
                     help="Blocks of random weights in the built checkpoint."),
        click.option("--span", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Blocks per server (servers = blocks / span, the last one takes the rest)."),
        click.option("--device", default="cpu", show_default=True, help="Servers' --device (cuda for GPU servers)."),
        click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
                     help="--compute-threads of each server."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def start_span_servers(swarm: LocalSwarm, path: Path, span: int, *options: str) -> list:
    """Servers of ``span`` blocks each over the checkpoint's blocks (the last also ``--head``), started together
    and waited for."""
    from swarm.models.loading import ModelFiles

    num_layers = ModelFiles(path).config.num_layers
    servers = [swarm.start_server(str(path), f"{start}:{min(start + span, num_layers)}", *options,
                                  *(["--head"] if start + span >= num_layers else []), wait=False)
               for start in range(0, num_layers, span)]
    for server in servers:
        swarm.wait_ready(server)
    return servers


@click.command("realscale")
@swarm_options
@gen_length_option(type=click.IntRange(min=1), default=16, show_default=True,
              help="Tokens generated per run (one block; steps = gen length).")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=16, show_default=True,
              help="Prompt length in tokens.")
def realscale(model: Optional[str], blocks: int, span: int, gen_length: int, prompt_tokens: int, device: str,
              threads: int) -> None:
    """Per-step costs at LLaDA-8B's widths: float32 vs bfloat16 wire, head over all rows, the active block or on
    the swarm."""
    from swarm.models.loading import ModelFiles

    logging.basicConfig(level=logging.WARNING)
    settings = dict(gen_length=gen_length, steps=gen_length, block_length=gen_length, seed=0)
    prompt = [SPECIALS["<|startoftext|>"]] + [1 + i % len(WORDS) for i in range(prompt_tokens - 1)]
    with checkpoint(model, blocks) as path, LocalSwarm() as swarm:
        num_layers = ModelFiles(path).config.num_layers
        swarm.start_bootstrap()
        figures, server_rss = [], []
        for wire in ("auto", "float32"):
            servers = start_span_servers(swarm, path, span, "--wire-dtype", wire, "--device", device,
                                         "--compute-threads", str(threads), "--dht-prefix", f"realscale-{wire}")
            if any(s.uses_expert and s.wire_dtype == wire for s in SETTINGS):
                servers.append(swarm.start_server(str(path), None, "--expert", f"{EXPERT_DOMAIN}={path}",
                                                  "--device", device, "--compute-threads", str(threads),
                                                  "--dht-prefix", f"realscale-{wire}", name="expert"))
            for setting in [s for s in SETTINGS if s.wire_dtype == wire]:
                figures.append(run_setting(path, swarm, servers, prompt, settings, setting))
            server_rss = [rss_mb(server.process.pid) for server in servers]
            for server in servers:
                swarm.terminate(server)
        print_table(figures, server_rss)
        plain = [f for f, s in zip(figures, [s for w in ("auto", "float32") for s in SETTINGS if s.wire_dtype == w])
                 if "fp32 client" not in f.label and not s.uses_expert and not s.lora_rank
                 and not {"cache", "staleness"} & set(dict(s.generation))]
        same = len({tuple(f.tokens) for f in plain}) == 1
        click.echo(f"tokens identical across the exact bfloat16-client settings without an expert: {same}")
        print_projection(figures, prompt_tokens + gen_length, num_layers)


def run_setting(path: Path, swarm: LocalSwarm, servers, prompt: list[int], settings: dict,
                setting: Setting) -> StepFigures:
    from swarm.client import DistributedDiffusionLM

    wire = setting.wire_dtype
    # Spot checks off, as the figures were measured: a checked hop would load the head, or recompute 8B-wide blocks
    with DistributedDiffusionLM.from_pretrained(path, initial_peers=swarm.initial_peers, wire_dtype=wire,
                                                head_rows=setting.head_rows, dht_prefix=f"realscale-{wire}",
                                                dtype=setting.client_dtype, head=setting.head,
                                                request_timeout=120, connect_timeout=60, spot_check_fraction=0) as lm:
        click.echo(f"running: {setting.label} ...", err=True)
        generation = dict(settings, **dict(setting.generation))
        with tempfile.TemporaryDirectory(prefix="realscale-lora-") as folder:
            if setting.lora_rank:
                generation["adapter"] = str(random_lora(lm, setting.lora_rank, Path(folder)))
            return measure(lm, servers, prompt, generation, setting.label)


def random_lora(lm, rank: int, directory: Path) -> Path:
    """A LoRA adapter of ``rank`` with random weights for every projection of every block of ``lm``'s model,
    saved in ``directory``: what a published LoRA costs per step, whatever it learned."""
    import torch

    from swarm.adapters.adapter import AdapterConfig, LoRAAdapter, base_of
    from swarm.adapters.kinds import LORA

    config = AdapterConfig(0, lm.config.hidden_size, base_of(lm.config, lm.tokenizer), LORA,
                           num_blocks=lm.config.num_layers, rank=rank)
    weights = 0.01 * torch.randn(config.shape, generator=torch.Generator().manual_seed(0))
    return LoRAAdapter(config, weights).save(directory)
