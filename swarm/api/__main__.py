"""``python -m swarm.api --initial-peers ... --port 8000``: serve the OpenAI-style API over the swarm or locally.

FastAPI, uvicorn and the model are imported after the arguments are checked, so that ``--help`` answers at once.
"""
from __future__ import annotations

from typing import Optional

import click

from swarm.api.body_limit import DEFAULT_MAX_BODY_BYTES
from swarm.cli.options import (
    SwarmCommand,
    apply_threads,
    config_options,
    network_options,
    pop_config_kwargs,
    pop_network_config,
    run_main,
    setup_logging,
    threads_option,
)
from swarm.client.config import ClientConfig
from swarm.dht.peers import resolve_initial_peers
from swarm.models.config import DEFAULT_MODEL


@click.command(cls=SwarmCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--model", default=DEFAULT_MODEL,
              help="Embedded model name, checkpoint directory, Hugging Face repo id ORG/NAME[@REVISION] or (with "
                   "--initial-peers) a swarm model id or published NAME[@PUBLISHER] (the client reads its tokenizer, "
                   "embeddings and head; from a repo or peers it fetches only those).")
@click.option("--model-name", default=None,
              help="Model id clients pass as 'model' (default: the model's DHT prefix, e.g. 'default').")
@click.option("--local", is_flag=True, help="Run the whole model in this process instead of through a swarm.")
@click.option("--host", default="127.0.0.1", help="Address to listen on; 0.0.0.0 accepts other machines.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, help="TCP port to listen on.")
@click.option("--max-pending", type=click.IntRange(min=1), default=16,
              help="Requests allowed to wait for the model; more get 503.")
@click.option("--request-memory-mb", type=click.IntRange(min=1), default=None,
              help="Memory one request's denoiser calls may hold (window x CFG rows x calls in flight x models x "
                   "sequence); larger requests get 400. Default: a quarter of this machine's memory, never less "
                   "than one sequence at full context.")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=DEFAULT_MAX_BODY_BYTES,
              help="Largest request body accepted; larger ones get 413 before they are read or parsed.")
@click.option("--allow-expert", "allow_experts", multiple=True,
              help="With --local: an expert name or checkpoint directory requests may name, besides the embedded "
                   "experts (repeatable). Requests naming any other expert get 400.")
@network_options
@config_options(ClientConfig)  # the client's settings offered on the command line (swarm/client/config.py)
@threads_option()
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING"]), default="INFO",
              help="Logging verbosity.")
def main(model: str, model_name: Optional[str], local: bool, host: str, port: int,
         max_pending: int, request_memory_mb: Optional[int], max_body_bytes: int, allow_experts: tuple[str, ...],
         threads: Optional[int], log_level: str, **options) -> None:
    """Serve /v1/completions, /v1/chat/completions, /v1/models and /health in the OpenAI API's shape.

    A --port (or --host-maddrs port) in use is refused before the model loads (exit 4); docs/OPERATIONS.md lists
    every exit code."""
    setup_logging(log_level)
    network = pop_network_config(options, client_mode=True)
    client_options = pop_config_kwargs(options, ClientConfig)
    dht_prefix = client_options.pop("dht_prefix", None)  # names the model locally too
    if not local and not resolve_initial_peers(network.initial_peers, use_defaults=network.use_default_peers):
        raise click.UsageError("no swarm to join: pass --initial-peers (or set $SWARM_INITIAL_PEERS), "
                               "or use --local to run the model in this process")
    import uvicorn

    from swarm.api import create_app, load_engine
    from swarm.dht.node import check_port_free

    check_port_free(host, port, where=" (--port)")
    apply_threads(threads)
    engine = load_engine(model, local=local, network=network, dht_prefix=dht_prefix, model_id=model_name,
                         max_pending=max_pending, request_memory_mb=request_memory_mb, allow_experts=allow_experts,
                         client_options=client_options)
    click.echo(serving_lines(engine.model_id, engine.mode, host, port), err=True)
    try:
        uvicorn.run(create_app(engine, max_body_bytes), host=host, port=port, log_level=log_level.lower())
    finally:
        engine.close()


def serving_lines(model_id: str, mode: str, host: str, port: int) -> str:
    """The start message: the API's base URL, and the pages a newcomer opens in a browser (docs/WEB.md)."""
    base = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    return (f"Serving model {model_id!r} ({mode}) on {base}/v1\n"
            f"  swarm map:  {base}/map\n"
            f"  playground: {base}/playground")


if __name__ == "__main__":
    run_main(main)
