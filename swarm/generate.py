"""``python -m swarm.generate "prompt"``: generate text with the embedded model, locally or through a swarm.

The options are made from declarations (the sampler's and the request's settings, the client's
:class:`~swarm.client.config.ClientConfig`); torch and the network load only once the command line is parsed, and
the request's settings are checked against the model before any swarm is joined, so a mistake is answered at once.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import click

from swarm.cli.options import (
    EXIT_HALTED,
    CLIError,
    SwarmCommand,
    apply_threads,
    config_options,
    generation_options,
    halt_message,
    pop_config_kwargs,
    pop_generation_kwargs,
    require_no_options_left,
    run_main,
    setup_logging,
    threads_option,
)
from swarm.client.config import ClientConfig
from swarm.dht.peers import split_peers
from swarm.models.config import DEFAULT_MODEL, DTYPE_NAMES
from swarm.utils.progress import StepLine


@click.command(cls=SwarmCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("prompt")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="Embedded model name, checkpoint directory, Hugging Face repo id ORG/NAME[@REVISION], or (with "
                   "--initial-peers) a swarm model id or published NAME[@PUBLISHER].")
@click.option("--initial-peers", multiple=True,
              help="Multiaddr of a swarm peer (repeatable); without any, the model runs in this process.")
@config_options(ClientConfig, help_prefix="With --initial-peers: ")  # declared in swarm/client/config.py
@click.option("--dtype", type=click.Choice(DTYPE_NAMES), default=None,
              help="dtype of the local model or of the client's embedding and head. Default: the checkpoint's, as "
                   "servers use (another gives other tokens than default servers).")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Show the text after every denoising step.")
@threads_option()
@generation_options  # every sampler setting and request option (swarm.diffusion.config, swarm.frontend.request)
def main(prompt: str, model: str, initial_peers: tuple[str, ...], dtype: Optional[str], stream: bool,
         threads: Optional[int], **options: Any) -> None:
    """Generate a continuation of PROMPT.

    Exits 5 with a message when the swarm's governance halts the generation (docs/OPERATIONS.md lists every
    exit code)."""
    setup_logging(logging.WARNING)
    settings = pop_generation_kwargs(options)
    client_options = pop_config_kwargs(options, ClientConfig)
    require_no_options_left(options)
    peers = split_peers(initial_peers, "--initial-peers")  # a malformed one is refused before anything loads
    apply_threads(threads)  # --threads, else the default the Python API chooses too
    check_before_loading(model, peers, settings)
    lm = open_model(model, peers, dtype, client_options)
    result, line = None, StepLine(enabled=stream)
    try:
        for chunk in lm.generate_stream(prompt, **settings):
            if not chunk.done:
                line.show(f"[step {chunk.step + 1}] {prompt}{chunk.text}")
            result = chunk.result
    finally:
        line.close()  # an error's line starts on a line of its own
        if hasattr(lm, "shutdown"):
            lm.shutdown()
    if result.finish_reason == "halted":
        raise CLIError(halt_message(result.info["halt"]), EXIT_HALTED)
    click.echo(prompt + result.text)
    used = result.info["settings"]
    click.echo(f"({result.steps} steps, {result.denoiser_calls} denoiser calls, {result.elapsed_s:.2f} s, "
               f"finish: {result.finish_reason}; temperature {used['temperature']:g}, remasking {used['remasking']}, "
               f"seed {used['seed']})", err=True)


def check_before_loading(model: str, peers: list[str], settings: dict[str, Any]) -> None:
    """Refuse request settings that cannot fit the model (``--gen-length 5000``) from its config alone, before
    the weights load or a swarm is joined (the prompt counts as one token until it is tokenised)."""
    from swarm.diffusion.config import GenerationLimits
    from swarm.frontend.lm import check_request
    from swarm.frontend.request import GenerationRequest
    from swarm.models.loading import ModelFiles

    try:
        files = ModelFiles(model)
    except FileNotFoundError:
        if peers:  # a swarm model id or published name: its config comes from peers, and generate checks then
            return
        raise
    options, sampler_settings = GenerationRequest.split(settings)
    check_request(GenerationLimits.for_model(files.config), files.sampling_defaults(), bool(peers), None, options,
                  sampler_settings)


def open_model(model: str, peers: list[str], dtype: Optional[str], client_options: dict[str, Any]) -> Any:
    """The swarm client when peers are given, else the model in this process."""
    if peers:
        from swarm.client.model import DistributedDiffusionLM

        return DistributedDiffusionLM.from_pretrained(model, initial_peers=peers, dtype=dtype, **client_options)
    from swarm.frontend.local import DiffusionLM

    return DiffusionLM.from_pretrained(model, dtype=dtype)


if __name__ == "__main__":
    run_main(main)
