"""``python -m swarm.generate "prompt"``: generate text with the embedded model, locally or through a swarm."""
from __future__ import annotations

import logging
import sys

import click

from swarm.cli_options import (
    EXIT_HALTED,
    CLIError,
    SwarmCommand,
    apply_threads,
    generation_options,
    halt_message,
    pop_generation_kwargs,
    require_no_options_left,
    run_main,
    setup_logging,
    threads_option,
)
from swarm.client.config import HEAD_PLACES
from swarm.dht.peers import split_peers
from swarm.models.loading import DEFAULT_MODEL


@click.command(cls=SwarmCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("prompt")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="Embedded model name, checkpoint directory or Hugging Face repo id ORG/NAME[@REVISION].")
@click.option("--initial-peers", multiple=True,
              help="Multiaddr of a swarm peer (repeatable); without any, the model runs in this process.")
@click.option("--push", is_flag=True,
              help="With --initial-peers: servers pass activations straight to the next server (fewer network "
                   "crossings).")
@click.option("--allow-approximate", is_flag=True,
              help="With --initial-peers: also route through servers whose numerics differ from the checkpoint's "
                   "(another --dtype, --quant int8); the result then names them. Default: exact servers only.")
@click.option("--head", "head_place", type=click.Choice(HEAD_PLACES), default="auto", show_default=True,
              help="With --initial-peers: where the output head runs. auto: on the last server when it offers it "
                   "(--head), else here; client: always here.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="dtype of the local model or of the client's embedding and head. Default: the checkpoint's, as "
                   "servers use (another gives other tokens than default servers).")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Show the text after every denoising step.")
@threads_option()
@generation_options  # every sampler setting and request option (swarm.diffusion.config, swarm.lm.GenerationRequest)
def main(prompt: str, model: str, initial_peers: tuple[str, ...], push: bool, allow_approximate: bool,
         head_place: str, dtype: str | None, stream: bool, threads: int | None, **options) -> None:
    """Generate a continuation of PROMPT.

    Exits 5 with a message when the swarm's governance halts the generation (docs/OPERATIONS.md lists every
    exit code)."""
    setup_logging(logging.WARNING)
    settings = pop_generation_kwargs(options)
    require_no_options_left(options)
    peers = split_peers(initial_peers, "--initial-peers")  # a malformed one is refused before anything loads
    apply_threads(threads)
    if peers:
        from swarm.client import DistributedDiffusionLM

        lm = DistributedDiffusionLM.from_pretrained(model, initial_peers=peers, push=push, dtype=dtype,
                                                    allow_approximate=allow_approximate, head=head_place)
    else:
        from swarm.local import DiffusionLM

        lm = DiffusionLM.from_pretrained(model, dtype=dtype)
    try:
        result = None
        for chunk in lm.generate_stream(prompt, **settings):
            if stream and not chunk.done and sys.stderr.isatty():
                click.echo(f"\r[step {chunk.step + 1}] {prompt}{chunk.text}"[:200], nl=False, err=True)
            result = chunk.result
    finally:
        if hasattr(lm, "shutdown"):
            lm.shutdown()
    if stream and sys.stderr.isatty():
        click.echo("", err=True)
    if result.finish_reason == "halted":
        raise CLIError(halt_message(result.info["halt"]), EXIT_HALTED)
    click.echo(prompt + result.text)
    click.echo(f"({result.steps} steps, {result.denoiser_calls} denoiser calls, {result.elapsed_s:.2f} s, "
               f"finish: {result.finish_reason})", err=True)


if __name__ == "__main__":
    run_main(main)
