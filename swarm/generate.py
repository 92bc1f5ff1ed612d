"""``python -m swarm.generate "prompt"``: generate text with the embedded model, locally or through a swarm.

The options are made from declarations (the sampler's and the request's settings, the client's
:class:`~swarm.client.config.ClientConfig`); torch and the network load only once the command line is parsed, and
the request's settings are checked against the model before any swarm is joined, so a mistake is answered at once.
"""
from __future__ import annotations

import json
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
from swarm.dht.peers import resolve_initial_peers
from swarm.models.config import DEFAULT_MODEL, DTYPE_NAMES
from swarm.utils.progress import StepLine

PLAIN_PROGRESS_EVERY = 16  # off a terminal, one progress line per this many steps (and the last one)


@click.command(cls=SwarmCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("prompt")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="Embedded model name, checkpoint directory, Hugging Face repo id ORG/NAME[@REVISION], or (through a "
                   "swarm) a swarm model id or published NAME[@PUBLISHER].")
@click.option("--initial-peers", multiple=True,
              help="Multiaddr of a swarm peer (repeatable). Default: $SWARM_INITIAL_PEERS, then the bootstrap-list "
                   "file ($SWARM_BOOTSTRAP_FILE or the packaged swarm/bootstrap_peers.txt), as every command reads "
                   "them; with none of these (or --local) the model runs in this process.")
@click.option("--local", is_flag=True, default=False,
              help="Run the model in this process even when initial peers are known (from the flag, the "
                   "environment or the bootstrap file).")
@config_options(ClientConfig, help_prefix="Through a swarm: ")  # declared in swarm/client/config.py
@click.option("--dtype", type=click.Choice(DTYPE_NAMES), default=None,
              help="dtype of the local model or of the client's embedding and head. Default: the checkpoint's, as "
                   "servers use (another gives other tokens than default servers).")
@click.option("--stream/--no-stream", default=True, show_default=True,
              help="Show the text after every denoising step: redrawn in place on a terminal; elsewhere (a log, a "
                   f"pipe) one line per {PLAIN_PROGRESS_EVERY} steps and the last.")
@click.option("--quiet", "-q", is_flag=True, default=False,
              help="Print only the generated text (or the JSON): no progress and no summary line.")
@click.option("--json", "as_json", is_flag=True, default=False,
              help="Print the result as one JSON object instead of the text, for scripts: prompt, text (the "
                   "continuation alone: the plain output prints prompt + text), token ids, finish reason, where it "
                   "ran, and the result's info with the settings used.")
@threads_option()
@generation_options  # every sampler setting and request option (swarm.diffusion.config, swarm.frontend.request)
def main(prompt: str, model: str, initial_peers: tuple[str, ...], local: bool, dtype: Optional[str], stream: bool,
         quiet: bool, as_json: bool, threads: Optional[int], **options: Any) -> None:
    """Generate a continuation of PROMPT, through the swarm when peers are known, else in this process.

    The summary line (stderr) says where it ran: "local", or the route with each server's short peer id and
    blocks. Exits 5 with a message when the swarm's governance halts the generation (docs/OPERATIONS.md lists every
    exit code)."""
    setup_logging(logging.WARNING)
    settings = pop_generation_kwargs(options)
    client_options = pop_config_kwargs(options, ClientConfig)
    require_no_options_left(options)
    peers = choose_peers(initial_peers, local)  # a malformed one is refused before anything loads
    apply_threads(threads)  # --threads, else the default the Python API chooses too
    check_before_loading(model, peers, settings)
    lm = open_model(model, peers, dtype, client_options)
    result = None
    line = StepLine(enabled=stream and not quiet and not as_json, plain_every=PLAIN_PROGRESS_EVERY)
    try:
        for chunk in lm.generate_stream(prompt, **settings):
            if not chunk.done:
                line.show(f"[step {chunk.step + 1}] {prompt}{chunk.text}")
            result = chunk.result
        if client_options.get("evidence_auditors") and hasattr(lm, "hand_audit_sample"):
            lm.hand_audit_sample()  # --evidence-to: the hand-off after the generation ends before the client stops
    finally:
        line.close()  # an error's line starts on a line of its own
        if hasattr(lm, "shutdown"):
            lm.shutdown()
    if result.finish_reason == "halted":
        raise CLIError(halt_message(result.info["halt"]), EXIT_HALTED)
    if as_json:
        click.echo(json.dumps(result_record(prompt, result), default=str))
    else:
        click.echo(prompt + result.text)
    if not quiet:
        click.echo(summary_line(result), err=True)


def choose_peers(initial_peers: tuple[str, ...], local: bool) -> list[str]:
    """The peers to generate through: none with ``--local``; else the flag's, $SWARM_INITIAL_PEERS or the bootstrap
    file, as every other command reads them (:func:`~swarm.dht.peers.resolve_initial_peers`)."""
    if local:
        if initial_peers:
            raise click.UsageError("--local runs the model in this process: drop --initial-peers, or --local")
        return []
    return resolve_initial_peers(initial_peers)  # a malformed one: a ValueError naming where it came from


def where_it_ran(result: Any) -> str:
    """"local", or the route: each hop's short peer id and blocks (the last route used, after any failover)."""
    route = result.info.get("route")
    return " -> ".join(route) if route else "local"


def summary_line(result: Any) -> str:
    used = result.info["settings"]
    return (f"({result.steps} steps, {result.denoiser_calls} denoiser calls, {result.elapsed_s:.2f} s, "
            f"finish: {result.finish_reason}; temperature {used['temperature']:g}, remasking {used['remasking']}, "
            f"seed {used['seed']}; ran: {where_it_ran(result)})")


def result_record(prompt: str, result: Any) -> dict[str, Any]:
    """What ``--json`` prints: the result's fields a script reads, and its ``info`` whole."""
    return {"prompt": prompt, "text": result.text, "token_ids": list(result.token_ids),
            "prompt_ids": list(result.prompt_ids), "finish_reason": result.finish_reason, "steps": result.steps,
            "denoiser_calls": result.denoiser_calls, "elapsed_s": result.elapsed_s, "ran": where_it_ran(result),
            "info": result.info}


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
