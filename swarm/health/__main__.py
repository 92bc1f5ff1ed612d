"""``python -m swarm.health``: print the swarm's health map; the exit code says whether the model is served.

Exit codes (shared by every command, docs/OPERATIONS.md): 0 every block has an online server, 1 some block has
none (scripts and probes can alert on it), 2 bad command line (no initial peers at all, too), 3 the swarm could not
be joined.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable, Optional

import click

from swarm.cli.options import (
    EXIT_NOT_SERVED,
    EXIT_UNREACHABLE,
    CLIError,
    SwarmCommand,
    network_options,
    pop_network_config,
    run_main,
    setup_logging,
)
from swarm.dht.config import NetworkConfig
from swarm.dht.peers import resolve_initial_peers

if TYPE_CHECKING:
    from swarm.health.map import HealthMap


class UnreachableSwarm(CLIError):
    def __init__(self, message: str):
        super().__init__(message, EXIT_UNREACHABLE)


def client_network(options: dict) -> NetworkConfig:
    """As every command's, refusing no peers at all: an empty DHT of its own would only say "nothing served"."""
    network = pop_network_config(options, client_mode=True)
    if not resolve_initial_peers(network.initial_peers, use_defaults=network.use_default_peers):
        raise click.UsageError("no swarm to ask: pass --initial-peers (or set $SWARM_INITIAL_PEERS, or list peers in "
                               "$SWARM_BOOTSTRAP_FILE)")
    return network


def resolve_target(model: Optional[str], dht_prefix: Optional[str], num_blocks: Optional[int]) -> tuple[str, int]:
    """The DHT prefix and block count to inspect.

    With both ``--dht-prefix`` and ``--num-blocks`` no checkpoint is needed, so an operator can check a model
    they do not have; otherwise the checkpoint's config fills what is missing, as servers do.
    """
    if dht_prefix is not None and num_blocks is not None:
        return dht_prefix, num_blocks
    from swarm.dht.schema import default_prefix
    from swarm.models.loading import DEFAULT_MODEL, ModelFiles

    try:
        files = ModelFiles(model or DEFAULT_MODEL)
    except (FileNotFoundError, ValueError) as error:
        raise click.UsageError(f"{error} (or give --dht-prefix and --num-blocks)") from error
    return dht_prefix or default_prefix(files.path), num_blocks or files.config.num_layers


def target_options(command: Callable) -> Callable:
    """``--model``, ``--dht-prefix`` and ``--num-blocks``: the model whose swarm a command reads
    (:func:`resolve_target`)."""
    options = [
        click.option("--model", default=None, help="Embedded model name or checkpoint directory; gives the DHT "
                     "prefix and block count. Default: the embedded 'default' model."),
        click.option("--dht-prefix", default=None, help="DHT namespace of the model, as servers were started with "
                     "(default: the model directory's name)."),
        click.option("--num-blocks", type=click.IntRange(min=1), default=None,
                     help="Number of transformer blocks of the model (default: from the model's config)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def read_map(network: NetworkConfig, prefix: str, num_blocks: int, auditors: tuple[str, ...] = (),
             usage: bool = False, coordinators: tuple[str, ...] = ()) -> HealthMap:
    """The health map read from the swarm; hivemind is imported here, after the arguments are checked."""
    from swarm.dht.node import start_dht, stop_dht
    from swarm.dht.schema import protected_keys
    from swarm.health.map import read_health_map

    try:
        dht = start_dht(network, protect=protected_keys(prefix, num_blocks, auditors=auditors,
                                                        coordinators=coordinators))  # warns of lost replies
    except Exception as error:  # hivemind raises daemon, timeout and parse errors alike; all mean "cannot join"
        raise UnreachableSwarm(f"could not join the swarm: {error}") from error
    from swarm.utils.event_loop import BackgroundLoop
    from swarm.wire.remote import RemoteCaller

    loop = BackgroundLoop.shared()
    caller = RemoteCaller(loop.run(dht.replicate_p2p()))  # the probes' connection: stop_dht closes it first
    try:
        return read_health_map(dht, prefix, num_blocks, adapters=True, auditors=auditors, usage=usage,
                               probe_with=caller, coordinators=coordinators)
    finally:
        stop_dht(dht)


def serve_page(network: NetworkConfig, prefix: str, num_blocks: int, host: str, port: int, log_level: str,
               auditors: tuple[str, ...] = (), coordinators: tuple[str, ...] = ()) -> None:
    """``--serve``: the live map page (docs/WEB.md) until SIGINT / SIGTERM; prints ``MAP READY <url>``. The page
    shows the reports of ``auditors`` and the streams of ``coordinators`` (base64 keys)."""
    import uvicorn  # noqa: F401 (imported where it serves; here a missing one is named before the swarm is joined)

    from swarm.web.server import listen, serve_map  # FastAPI too
    from swarm.web.watcher import own_access
    try:
        sock = listen(host, port)
    except OSError as error:
        raise click.UsageError(f"cannot listen on {host}:{port}: {error}") from error
    try:
        access = own_access(network, prefix, num_blocks, auditors, coordinators)
    except Exception as error:  # as read_map: daemon, timeout and parse errors all mean "cannot join"
        sock.close()
        raise UnreachableSwarm(f"could not join the swarm: {error}") from error
    serve_map(access, sock, log_level, announce=lambda url: click.echo(f"MAP READY {url}", err=True))


@click.command(cls=SwarmCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@network_options
@target_options
@click.option("--json", "as_json", is_flag=True, help="Print the map as JSON instead of a table.")
@click.option("--trusted-auditors", "--trusted-auditor", "trusted_auditors", multiple=True,
              help="Auditor whose signed reports the map shows (base64 public key or a file holding one; repeatable). "
                   "Default: the governance keys ($SWARM_GOVERNANCE_KEYS); 'none' shows no audit.")
@click.option("--trusted-coordinators", "--trusted-coordinator", "trusted_coordinators", multiple=True,
              help="Stream coordinator whose signed stream records the map shows (base64 public key or a file holding "
                   "one; repeatable). Default: the governance keys; 'none' shows no streams.")
@click.option("--usage", is_flag=True, help="Also ask each online server what it computed for its callers "
              "(rpc_info: tokens, compute seconds, requests, callers, its --max-share-per-caller and refusals, the "
              "heaviest callers), from the call that checks it answers (3 s at most each).")
@click.option("--serve", is_flag=True, help="Serve the live map as a web page (/map, its data at /map.json) until "
              "interrupted, instead of printing it once.")
@click.option("--host", default="127.0.0.1", help="With --serve: address to listen on; 0.0.0.0 accepts other "
              "machines.")
@click.option("--port", type=click.IntRange(0, 65535), default=8100,
              help="With --serve: TCP port to listen on (0 picks a free one; the URL is printed).")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), default="WARNING",
              help="Logging verbosity.")
def main(model: Optional[str], dht_prefix: Optional[str], num_blocks: Optional[int], as_json: bool,
         trusted_auditors: tuple[str, ...], trusted_coordinators: tuple[str, ...], usage: bool, serve: bool, host: str,
         port: int, log_level: str, **options) -> None:
    """Show which servers serve which blocks of a model, which blocks no online server holds, and each server's
    latest check by a trusted auditor, the trusted coordinators' domain streams (and, with --usage, what each server
    computed for its callers)."""
    setup_logging(log_level)
    network = client_network(options)  # a malformed peer is refused before a model's config is read
    prefix, num_blocks = resolve_target(model, dht_prefix, num_blocks)
    from swarm.reports.records import trusted_auditors as auditor_keys

    try:
        auditors = tuple(auditor_keys(trusted_auditors))
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--trusted-auditors") from None
    try:
        coordinators = tuple(auditor_keys(trusted_coordinators))  # keys read as auditors' are
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--trusted-coordinators") from None
    if serve:
        serve_page(network, prefix, num_blocks, host, port, log_level, auditors, coordinators)
        return
    health = read_map(network, prefix, num_blocks, auditors, usage, coordinators)
    from swarm.health.render import render_text

    click.echo(json.dumps(health.to_json(), indent=2) if as_json else render_text(health))
    if not health.fully_served:
        raise SystemExit(EXIT_NOT_SERVED)


if __name__ == "__main__":
    run_main(main)
