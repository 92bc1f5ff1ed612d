"""``python -m swarm.benchmark adapter-wire``: what a LoRA costs on the wire at LLaDA-8B's widths, sent with every
call or named by digest once a server holds it (``ClientConfig.adapter_by_digest``).

Builds (or takes with ``--model``) the random-weight LLaDA-8B-width checkpoint of ``realscale``, starts servers of
``--span`` blocks (the last with ``--head``), and runs, side by side for both settings with the same seeds:

* training steps' swarm part: a forward pass with a trace and a backward pass of a random output gradient, each
  hop carrying its blocks' slice of a rank-``--rank`` LoRA of every projection; between steps the LoRA changes, as
  an optimizer step changes it, so every step's forward must send it;
* a generation with the same LoRA (its weights unchanged across denoising steps).

It prints bytes sent and received per step, seconds per step, and the servers' compute, then whether both settings
gave the same gradients and tokens (they must: only the wire differs). torch, the adapters and the models are
imported in the functions that use them, so that ``--help`` answers at once.
"""
from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import click

from swarm.adapters.kinds import LORA
from swarm.benchmark.realscale import (
    SPECIALS,
    WORDS,
    checkpoint,
    server_compute_seconds,
    start_span_servers,
    swarm_options,
)
from swarm.utils.local_swarm import LocalSwarm
from swarm.utils.text import plural

if TYPE_CHECKING:
    import torch


@dataclass
class WireFigures:
    """Per step of one phase (training or generation) under one setting."""

    sent: float  # bytes
    received: float
    seconds: float
    server_seconds: float
    outputs: list  # gradients (training) or tokens (generation): compared across settings


def measured(lm, servers, runs: int, run_step, steps_per_run: int = 1) -> WireFigures:
    """``run_step(i)`` ``runs`` times after one untimed warm-up run (route, connections); figures per step, a run
    being ``steps_per_run`` steps."""
    run_step(-1)
    caller = lm.caller
    sent, received = caller.bytes_sent, caller.bytes_received
    compute = server_compute_seconds(lm, servers)
    started = time.perf_counter()
    outputs = [run_step(run) for run in range(runs)]
    seconds = time.perf_counter() - started
    steps = runs * steps_per_run
    return WireFigures((caller.bytes_sent - sent) / steps, (caller.bytes_received - received) / steps,
                       seconds / steps, (server_compute_seconds(lm, servers) - compute) / steps, outputs)


def training_phase(lm, servers, weights: torch.Tensor, steps: int, rows: tuple[int, int]) -> WireFigures:
    """Forward with a trace, backward of a random output gradient; the LoRA changes after each step."""
    import torch

    from swarm.adapters.block import BlockAdapter

    weights = weights.clone()
    generator = torch.Generator().manual_seed(1)

    def step(_: int) -> torch.Tensor:
        hidden = (torch.randn(*rows, lm.config.hidden_size, generator=generator) * 0.5).to(lm.compute_dtype)
        trace: list = []
        adapter = BlockAdapter(LORA, weights)
        output = lm.sequence.forward(hidden, trace=trace, adapter=adapter)
        grad = torch.randn(output.shape, generator=generator) * 1e-3
        _, grad_weights = lm.sequence.backward_all(trace, grad, adapter)
        weights.sub_(1e-4 * grad_weights.sign())  # what an optimizer step does to the bytes: all change
        return grad_weights

    return measured(lm, servers, steps, step)


def generation_phase(lm, servers, adapter_path: str, prompt: list[int], steps: int) -> WireFigures:
    settings = dict(gen_length=steps, steps=steps, block_length=steps, seed=0, adapter=adapter_path)
    return measured(lm, servers, 1, lambda _: list(lm.generate(prompt, **settings).token_ids), steps_per_run=steps)


def print_rows(title: str, figures: dict[str, WireFigures]) -> None:
    click.echo(f"\n{title}")
    click.echo(f"{'setting':<34}{'sent MB':>10}{'received MB':>13}{'s / step':>10}{'server s':>10}")
    for label, f in figures.items():
        click.echo(f"{label:<34}{f.sent / 1e6:>10.2f}{f.received / 1e6:>13.2f}{f.seconds:>10.2f}"
                   f"{f.server_seconds:>10.2f}")
    every, named = figures.values()
    click.echo(f"{'ratio (every call / by digest)':<34}{every.sent / max(named.sent, 1):>10.2f}"
               f"{every.received / max(named.received, 1):>13.2f}{every.seconds / named.seconds:>10.2f}")


@click.command("adapter-wire")
@swarm_options
@click.option("--rank", type=click.IntRange(min=1), default=8, show_default=True, help="The LoRA's rank.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Rows of a training step.")
@click.option("--length", type=click.IntRange(min=1), default=32, show_default=True,
              help="Positions per row of a training step.")
@click.option("--train-steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed training steps per setting (after one warm-up step).")
@click.option("--gen-steps", type=click.IntRange(min=1), default=8, show_default=True,
              help="Denoising steps (and tokens) of the timed generation.")
def adapter_wire(model: Optional[str], blocks: int, span: int, rank: int, batch: int, length: int, train_steps: int,
                 gen_steps: int, device: str, threads: int) -> None:
    """A LoRA through the swarm at LLaDA-8B's widths: sent with every call vs named by digest."""
    import torch

    from swarm.adapters.adapter import AdapterConfig, LoRAAdapter, base_of
    from swarm.adapters.lora import BlockWidths, new_lora_weights
    from swarm.client import DistributedDiffusionLM
    from swarm.models.loading import ModelFiles

    logging.basicConfig(level=logging.WARNING)
    prompt = [SPECIALS["<|startoftext|>"]] + [1 + i % len(WORDS) for i in range(15)]
    with checkpoint(model, blocks) as path, LocalSwarm() as swarm, tempfile.TemporaryDirectory() as scratch:
        files = ModelFiles(path)
        config = files.config
        widths = BlockWidths.of(config)
        weights = new_lora_weights(widths, rank, config.num_layers, torch.Generator().manual_seed(0))
        with torch.no_grad():  # a trained LoRA's up projections are not zero: make the weights change the output
            weights.add_(torch.randn(weights.shape, generator=torch.Generator().manual_seed(2)) * 1e-3)
        swarm.start_bootstrap()
        servers = start_span_servers(swarm, path, span, "--device", device, "--compute-threads", str(threads),
                                     "--dht-prefix", "adapter-wire", "--request-timeout", "600")
        per_block = widths.rows(rank) * config.hidden_size * 4
        click.echo(f"LoRA rank {rank} of every projection: {per_block / 1e6:.2f} MB per block in float32, "
                   f"{per_block * config.num_layers / 1e6:.1f} MB for {config.num_layers} blocks; training rows "
                   f"{batch} x {length}, hidden states {batch * length * config.hidden_size * 2 / 1e6:.2f} MB "
                   "(bfloat16)", err=True)
        training, generation = {}, {}
        for label, by_digest in (("sent with every call", False), ("named by digest", True)):
            with DistributedDiffusionLM.from_pretrained(path, initial_peers=swarm.initial_peers,
                                                        dht_prefix="adapter-wire", adapter_by_digest=by_digest,
                                                        request_timeout=600, connect_timeout=60) as lm:
                adapter_path = Path(scratch) / "lora"
                if not adapter_path.exists():
                    adapter_config = AdapterConfig(0, config.hidden_size, base_of(config, lm.tokenizer), LORA,
                                                   num_blocks=config.num_layers, rank=rank)
                    LoRAAdapter(adapter_config, weights).save(adapter_path)
                click.echo(f"running: {label} ...", err=True)
                training[label] = training_phase(lm, servers, weights, train_steps, (batch, length))
                generation[label] = generation_phase(lm, servers, str(adapter_path), prompt, gen_steps)
        print_rows(f"training step (forward + backward through {plural(len(servers), 'server')}), per step", training)
        print_rows(f"generation with the LoRA ({gen_steps} denoising steps), per step", generation)
        every, named = (f.outputs for f in training.values())
        difference = max((a - b).abs().max().item() for a, b in zip(every, named))
        tokens = [f.outputs for f in generation.values()]
        click.echo(f"\nsame gradients in both settings: max difference {difference:.3g}; same tokens: "
                   f"{tokens[0] == tokens[1]}")
