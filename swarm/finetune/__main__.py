"""``python -m swarm.finetune --data pairs.jsonl --output DIR``: train an adapter (soft or deep prompt, bottleneck,
LoRA, head correction), here or on a swarm.

With ``--initial-peers`` the blocks run on the swarm's servers (forward and backward); without (or with
``--local-model``), the whole model runs in this process. Rerunning the same command resumes the run in DIR;
``--steps`` may be raised to go on. Processes started with the same ``--run-id`` train one adapter together
(``swarm/finetune/together.py``): the first prints the address the others join with ``--initial-peers``.
``python -m swarm.finetune publish DIR --name NAME --key KEY`` publishes an adapter (``swarm/finetune/publish.py``).

The options read plain modules only (:mod:`swarm.finetune.config`, the adapters' kinds); torch and hivemind are
imported after the arguments are parsed, so that ``--help`` and a mistyped flag answer at once.
"""
from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Optional

import click

from swarm.adapters.kinds import KINDS, MAX_PROMPT_LENGTH, MAX_RANK
from swarm.cli.options import SwarmCommand, apply_threads, run_main, setup_logging, threads_option
from swarm.dht.config import LOOPBACK_MADDRS, NetworkConfig
from swarm.dht.peers import split_peers
from swarm.finetune.config import CollaborationConfig, FinetuneConfig, parse_lr_from
from swarm.models.config import DEFAULT_MODEL
from swarm.utils.text import plural

if TYPE_CHECKING:
    from hivemind.dht import DHT

    from swarm.finetune.trainer import Finetuner
    from swarm.frontend.lm import BaseDiffusionLM


def open_model(model: str, peers: list[str], request_timeout: float, dht: Optional[DHT] = None) -> BaseDiffusionLM:
    """The swarm client with ``peers`` (on ``dht`` when given), else the local model."""
    if peers:
        from swarm.client import DistributedDiffusionLM

        return DistributedDiffusionLM.from_pretrained(model, initial_peers=peers, request_timeout=request_timeout,
                                                      dht=dht)
    from swarm.frontend.local import DiffusionLM

    return DiffusionLM.from_pretrained(model)


def lr_schedule(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]
                ) -> tuple[tuple[int, float], ...]:
    try:
        return parse_lr_from(values)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--lr-from") from None


@click.command(cls=SwarmCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--model", default=DEFAULT_MODEL, help="Embedded model name or checkpoint directory (the frozen base).")
@click.option("--initial-peers", multiple=True,
              help="Multiaddr of a swarm peer (repeatable): the blocks run on the swarm's servers. Without any, the "
                   "whole model runs in this process.")
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False),
              help='JSONL file, one {"prompt": ..., "response": ...} object per line.')
@click.option("--output", required=True, type=click.Path(file_okay=False),
              help="Adapter directory: written every --save-every steps; an existing run there is resumed.")
@click.option("--steps", type=click.IntRange(min=1), default=FinetuneConfig.steps,
              help="Optimizer steps in total (a resumed run goes on up to this many).")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=FinetuneConfig.lr,
              help="Adam learning rate of the adapter's tensors.")
@click.option("--lr-from", "lr_from", multiple=True, callback=lr_schedule,
              metavar="STEP:LR",
              help="From optimizer step STEP on, the learning rate is LR (repeatable: a step schedule; --lr before "
                   "the first). A resumed run may add or change entries for steps it has not taken yet, e.g. "
                   "--lr-from 2100:0.001 to anneal a run that stands at step 2100.")
@click.option("--batch-size", type=click.IntRange(min=1, max=1024), default=FinetuneConfig.batch_size,
              help="Examples per step.")
@click.option("--prompt-length", type=click.IntRange(min=1, max=MAX_PROMPT_LENGTH),
              default=FinetuneConfig.prompt_length,
              help="Prompt positions before every sequence: the adapter's vectors (per block for a deep prompt).")
@click.option("--adapter-kind", type=click.Choice(KINDS), default=FinetuneConfig.adapter_kind,
              help="soft_prompt (the default: servers only see more positions, any server serves it): vectors "
                   "before the first block; deep_prompt: vectors added before every block; bottleneck: a small "
                   "residual MLP of --rank per block, on every position (it changes what each position computes, "
                   "not only what it can attend to); lora: LoRA of --rank on every projection of every block (the "
                   "closest to training every weight; docs/TRAINING.md). The last three travel with each request "
                   "(push is off).")
@click.option("--rank", type=click.IntRange(min=1, max=MAX_RANK), default=FinetuneConfig.rank,
              help="With --adapter-kind bottleneck or lora: the rank of each block's adapter (a bottleneck: 2 x rank "
                   "x hidden weights per block; a LoRA: rank x (in + out) per projection).")
@click.option("--head-rank", type=click.IntRange(min=0, max=MAX_RANK), default=FinetuneConfig.head_rank,
              help="Also train a low-rank correction of the output head (held by the client, never sent; rank x "
                   "(hidden + vocabulary) weights), with any kind; 0: none. The default model needs one to end "
                   "answers with EOS (docs/TRAINING.md).")
@click.option("--down-scale", type=click.FloatRange(min=0, min_open=True, max=100), default=None,
              help="A new adapter's random down projections (a LoRA's, a bottleneck's, the head correction's) start "
                   "this many times unit scale. Under Adam a scale c makes the up projections learn c^2 times faster "
                   "than the down ones, as LoRA+'s learning-rate ratio (docs/TRAINING.md finding 4). Default: 4 for "
                   "lora, 1 for the other kinds; a resumed run keeps its own.")
@click.option("--max-grad-norm", type=click.FloatRange(min=0), default=None,
              help="Clip each batch's gradient to this norm before the optimizer step (with --run-id: each peer "
                   "its own batch's); 0: never. Keeps one huge gradient from throwing a run back (docs/TRAINING.md). "
                   "Default: 1 for lora, 0 for the other kinds; a resumed run keeps its own.")
@click.option("--pad-response", type=click.IntRange(min=0, max=1024), default=FinetuneConfig.pad_response,
              help="EOS-pad every response to at least this many tokens (use generation's --gen-length): the model "
                   "learns where an answer ends at the length it will generate.")
@click.option("--seed", type=int, default=FinetuneConfig.seed, help="Seeds the initial weights, batches and masking.")
@click.option("--save-every", type=click.IntRange(min=1), default=FinetuneConfig.save_every,
              help="Steps between saves of the adapter and the run's state.")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=60.0,
              help="Seconds one server may take for a forward or backward call (with --initial-peers).")
@click.option("--local-model", is_flag=True, default=False,
              help="Run the whole model in this process even with --initial-peers (they then serve only --run-id).")
@click.option("--run-id", default=None,
              help="Train together with every process started with this run id and the same --initial-peers "
                   "(hivemind.Optimizer); the first one prints the address the others join.")
@click.option("--target-batch-size", type=click.IntRange(min=1), default=None, show_default=False,
              help="With --run-id: examples of all peers together per optimizer step. Default: --batch-size.")
@click.option("--matchmaking-time", type=click.FloatRange(min=0, min_open=True),
              default=CollaborationConfig.matchmaking_time,
              help="With --run-id: seconds an averaging round waits for peers to join it.")
@click.option("--averaging-timeout", type=click.FloatRange(min=0, min_open=True),
              default=CollaborationConfig.averaging_timeout,
              help="With --run-id: seconds an averaging round may take before this peer steps on its own gradients.")
@click.option("--progress-expiration", type=click.FloatRange(min=0, min_open=True),
              default=CollaborationConfig.progress_expiration,
              help="With --run-id: seconds after which a silent peer (left or dead) no longer counts towards the "
                   "global batch.")
@click.option("--min-peers", type=click.IntRange(min=1), default=CollaborationConfig.min_peers,
              help="With --run-id: wait until this many peers (this one included) joined before the first step.")
@click.option("--peer-wait", type=click.FloatRange(min=0, min_open=True), default=CollaborationConfig.peer_wait,
              help="With --run-id: seconds to wait for --min-peers before giving up.")
@click.option("--host-maddrs", multiple=True, default=list(LOOPBACK_MADDRS),
              help="With --run-id: multiaddrs this peer listens on (repeatable); /ip4/0.0.0.0/tcp/PORT for other "
                   "machines.")
@click.option("--announce-maddrs", multiple=True,
              help="With --run-id: public multiaddrs to announce, e.g. behind port forwarding (repeatable).")
@threads_option()
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING"]), default="WARNING",
              help="Logging verbosity.")
def main(model: str, initial_peers: tuple[str, ...], request_timeout: float, threads: int | None, log_level: str,
         local_model: bool, run_id: Optional[str], target_batch_size: Optional[int], matchmaking_time: float,
         averaging_timeout: float, progress_expiration: float, min_peers: int, peer_wait: float,
         host_maddrs: tuple[str, ...], announce_maddrs: tuple[str, ...], **options) -> None:
    """Fine-tune an adapter (a soft or deep prompt, bottleneck adapters or LoRA) on prompt/response pairs with LLaDA's
    SFT objective (docs/TRAINING.md); use it with generate(..., adapter=OUTPUT) or python -m swarm.generate
    --adapter OUTPUT."""
    setup_logging(getattr(logging, log_level))
    peers = split_peers(initial_peers, "--initial-peers")
    config = FinetuneConfig(**options)
    if run_id is not None:
        config.collaboration = CollaborationConfig(run_id, target_batch_size or config.batch_size, matchmaking_time,
                                                   averaging_timeout, progress_expiration=progress_expiration,
                                                   min_peers=min_peers, peer_wait=peer_wait)
        config.collaboration.validate(config.batch_size)
    elif target_batch_size is not None:
        raise click.UsageError("--target-batch-size needs --run-id (alone, the batch is --batch-size)")
    from swarm.finetune.trainer import Finetuner  # after the checks: loads torch and hivemind

    apply_threads(threads)
    dht = join_run(config, peers, NetworkConfig(peers, list(host_maddrs), list(announce_maddrs),
                                                use_default_peers=False))
    lm, trainer = None, None
    try:
        lm = open_model(model, [] if local_model else peers, request_timeout, dht)
        trainer = Finetuner(lm, config, dht=dht)
        trainer.run(progress=True)
    finally:
        close(trainer, lm, dht)
    steps = plural(trainer.state.epoch, "step")
    click.echo(f"adapter written to {config.output}: {steps}, loss {trainer.smoothed_loss()} (mean of the last 10), "
               f"{trainer.state.wall_s:.1f} s of training"
               + (f", {plural(trainer.state.step, 'batch', 'batches')} here" if config.collaboration else ""))


def join_run(config: FinetuneConfig, peers: list[str], network: NetworkConfig) -> Optional[DHT]:
    """With a run id: this process's DHT peer (not in client mode: the others average with it), announced."""
    if config.collaboration is None:
        return None
    from swarm.dht.node import start_dht, visible_maddrs

    dht = start_dht(network)
    addresses = visible_maddrs(dht)
    click.echo(f"run {config.collaboration.run_id}: peer {dht.peer_id}; others join with --initial-peers "
               f"{addresses[0] if addresses else '?'}", err=True)
    return dht


def close(trainer: Optional[Finetuner], lm: Optional[BaseDiffusionLM], dht: Optional[DHT]) -> None:
    """Leave the collaboration, then stop the client and the DHT peer (each even if an earlier one failed)."""
    try:
        if trainer is not None:
            trainer.close()
    finally:
        try:
            if lm is not None and hasattr(lm, "shutdown"):
                lm.shutdown()
        finally:
            if dht is not None:
                from swarm.dht.node import stop_dht

                stop_dht(dht)


if __name__ == "__main__":
    if sys.argv[1:2] == ["publish"]:  # python -m swarm.finetune publish DIR --name NAME --key KEY (sharing)
        from swarm.finetune.publish import publish_main

        sys.argv.pop(1)
        run_main(publish_main)
    else:
        run_main(main)
