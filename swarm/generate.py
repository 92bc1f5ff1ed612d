"""``python -m swarm.generate "prompt"``: generate text with the embedded model, locally or through a swarm."""
from __future__ import annotations

import logging
import sys

import click

from swarm.cli_options import generation_options, pop_generation_kwargs, require_no_options_left
from swarm.models.loading import DEFAULT_MODEL


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("prompt")
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="Embedded model name or checkpoint directory.")
@click.option("--initial-peers", multiple=True,
              help="Multiaddr of a swarm peer (repeatable); without any, the model runs in this process.")
@click.option("--push", is_flag=True,
              help="With --initial-peers: servers pass activations straight to the next server (fewer network "
                   "crossings).")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Show the text after every denoising step.")
@click.option("--verbose", is_flag=True, help="Log at INFO level.")
@generation_options  # every sampler setting and request option (swarm.diffusion.config, swarm.lm.GenerationRequest)
def main(prompt: str, model: str, initial_peers: tuple[str, ...], push: bool, stream: bool, verbose: bool,
         **options) -> None:
    """Generate a continuation of PROMPT."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = pop_generation_kwargs(options)
    require_no_options_left(options)
    if initial_peers:
        from swarm.client import DistributedDiffusionLM

        lm = DistributedDiffusionLM.from_pretrained(model, initial_peers=list(initial_peers), push=push)
    else:
        from swarm.local import DiffusionLM

        lm = DiffusionLM.from_pretrained(model)
    try:
        result = None
        for chunk in lm.generate_stream(prompt, **settings):
            if stream and not chunk.done and sys.stderr.isatty():
                click.echo(f"\r[step {chunk.step + 1}] {prompt}{chunk.text}"[:200], nl=False, err=True)
            result = chunk.result
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    finally:
        if hasattr(lm, "shutdown"):
            lm.shutdown()
    if stream and sys.stderr.isatty():
        click.echo("", err=True)
    click.echo(prompt + result.text)
    click.echo(f"({result.steps} steps, {result.denoiser_calls} denoiser calls, {result.elapsed_s:.2f} s, "
               f"finish: {result.finish_reason})", err=True)


if __name__ == "__main__":
    main()
