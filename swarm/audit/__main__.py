"""``python -m swarm.audit --initial-peers ... --key KEY [--every SECONDS] [--once]``: a standing auditor.

Each round it sends every online server of the model a challenge shaped like a client's forward call, compares the
answer with its own copy of those blocks (the client's spot-check tolerance), measures the call against what the
server announces, and publishes one signed report under its key (docs/AUDIT.md). Clients that trust its key
(``--trusted-auditors``; by default the governance keys) avoid a server whose latest audit failed.

The key is an Ed25519 private key like a governance key (``python -m swarm.governance keygen --out auditor.key``).
torch and hivemind are imported only once the arguments are checked, so ``--help`` answers at once.
"""
from __future__ import annotations

import json
import logging
import signal
import threading
from typing import Any, Optional

import click

from swarm.audit.config import AuditorConfig
from swarm.cli.options import (
    EXIT_UNREACHABLE,
    CLIError,
    SwarmCommand,
    apply_threads,
    config_options,
    network_options,
    pop_config_kwargs,
    pop_network_config,
    require_no_options_left,
    run_main,
    setup_logging,
    threads_option,
)
from swarm.dht.peers import resolve_initial_peers
from swarm.models.config import DEFAULT_MODEL

logger = logging.getLogger("swarm.audit")


@click.command(cls=SwarmCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@network_options
@click.option("--key", "key_path", required=True, type=click.Path(dir_okay=False),
              help="The auditor's Ed25519 private key file (make one with `python -m swarm.governance keygen --out "
                   "auditor.key`); readers trust reports signed by its public half.")
@click.option("--model", default=DEFAULT_MODEL, help="Embedded model name, checkpoint directory, Hugging Face repo id "
              "ORG/NAME[@REVISION], or a swarm model id or published NAME[@PUBLISHER] (fetched from peers, each part "
              "checked against the manifest): the auditor recomputes every server's blocks with its own copy.")
@config_options(AuditorConfig)  # every, jitter, once, timeouts, tolerance, lifetime: swarm/audit/config.py
@click.option("--json", "as_json", is_flag=True, help="After the last round, print its report as JSON on stdout.")
@threads_option()
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), default="INFO",
              help="Logging verbosity (each round and each server's verdict are logged at INFO).")
def main(key_path: str, model: str, as_json: bool, threads: Optional[int], log_level: str, **options: Any) -> None:
    """Check every online server of a model on a schedule and publish signed audit reports."""
    setup_logging(log_level)
    network = pop_network_config(options, client_mode=True)
    config = AuditorConfig(network=network, **pop_config_kwargs(options, AuditorConfig))
    require_no_options_left(options)
    if not resolve_initial_peers(network.initial_peers, use_defaults=network.use_default_peers):
        raise click.UsageError("no swarm to audit: pass --initial-peers (or set $SWARM_INITIAL_PEERS)")
    from swarm.governance.keys import load_key_file

    try:
        key = load_key_file(key_path, role="auditor")
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--key") from None
    apply_threads(threads)
    from swarm.audit.auditor import Auditor
    from swarm.models.loading import ModelFiles
    from swarm.weights.source import SwarmWeights

    files = ModelFiles(model, resolvers=[SwarmWeights(network).resolve])  # a swarm id's blocks come from peers
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with Auditor(config, key, files) as auditor:
        logger.info("auditing %s as %s every %.0f s", auditor.prefix, auditor.public_key, config.every)
        result = auditor.run(stop)
    if as_json:
        click.echo(json.dumps(result.report.to_json(), indent=2, allow_nan=False))
    if not result.published:
        raise CLIError("the last report could not be read back from the swarm: readers do not see it (are the "
                       "initial peers part of the swarm?)", EXIT_UNREACHABLE)


if __name__ == "__main__":
    run_main(main)
