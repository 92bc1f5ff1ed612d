"""``python -m swarm.governance keygen | halt --reason ... | resume | status``: the swarm's kill switch.

``status`` exits 5 while the swarm is halted (the exit codes of every command are in docs/OPERATIONS.md).

Servers and clients that trust keys fail safe: when they read no valid decision by those keys for longer than
``--governance-stale-after`` / ``ClientConfig.governance_stale_after`` (120 s by default), they stop as if halted.
So publish a ``resume`` once when setting up keys; ``halt`` and ``resume`` report success only once the record is
read back from the swarm.

The keys and the DHT (hivemind) are imported in the commands' bodies, so that ``--help`` answers at once.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING

import click

from swarm.cli.options import (
    EXIT_HALTED,
    EXIT_UNREACHABLE,
    CLIError,
    SwarmGroup,
    network_options,
    pop_network_config,
    run_main,
    setup_logging,
    utc_time,
)
from swarm.dht.config import NetworkConfig
from swarm.dht.peers import resolve_initial_peers
from swarm.governance.limits import HALT, RESUME

if TYPE_CHECKING:
    from swarm.governance.records import Decision

STATUS_REREADS = (0.5, 1.0, 2.0)  # pauses before reading again when status reads no decision at first
PREFIX_HELP = "DHT prefix of the model to govern (servers' --dht-prefix; default: the embedded model's 'default')."


@click.group(cls=SwarmGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Create a governance key, and halt or resume the swarm with records signed by it."""
    setup_logging(logging.WARNING)


@main.command()
@click.option("--out", "path", default="governance.key", show_default=True, type=click.Path(dir_okay=False),
              help="Where to write the private key (refuses to overwrite).")
def keygen(path: str) -> None:
    """Create an Ed25519 governance key and print its public half (give it to servers and clients)."""
    from swarm.governance.keys import generate_private_key, public_key_text

    try:
        key = generate_private_key(path)
    except FileExistsError as error:
        raise click.UsageError(str(error)) from error
    public = public_key_text(key)
    with open(path + ".pub", "w") as file:
        file.write(public + "\n")
    click.echo(f"private key: {path} (keep it secret)\npublic key:  {public}  (also in {path}.pub)")
    click.echo("Start servers with --governance-key " + public + " (or SWARM_GOVERNANCE_KEYS).")


TRUSTED_HELP = ("Another trusted governance public key (base64 or file; repeatable; default $SWARM_GOVERNANCE_KEYS): "
                "the new decision's sequence number goes above theirs too.")


def _private_key(path: str):
    """The governance private key in ``path``, or one line saying what the file is instead."""
    from swarm.governance.keys import load_key_file

    try:
        return load_key_file(path)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--key") from None


def _network(options: dict) -> NetworkConfig:
    """A client's network config; refused up front when it names no peer (nothing could store a record)."""
    network = pop_network_config(options, client_mode=True)
    if not resolve_initial_peers(network.initial_peers, use_defaults=network.use_default_peers):
        raise click.UsageError("no swarm to join: pass --initial-peers (or set $SWARM_INITIAL_PEERS)")
    return network


def describe(decision: Decision) -> str:
    """``halt #3 signed 2026-12-01 18:15:05 UTC``."""
    return f"{decision.action} #{decision.sequence} signed {utc_time(decision.timestamp)}"


def _parse_keys(texts: tuple[str, ...]) -> list:
    from swarm.governance.keys import parse_public_key

    try:
        return [parse_public_key(k) for k in texts]
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--governance-key") from None


def _decision_command(action: str):
    @click.option("--key", "key_path", required=True, type=click.Path(exists=True, dir_okay=False),
                  help="The governance private key file.")
    @click.option("--reason", default="", help="Why: shown to every client the decision stops or resumes.")
    @click.option("--dht-prefix", default="default", show_default=True, help=PREFIX_HELP)
    @click.option("--governance-key", "trusted", multiple=True, help=TRUSTED_HELP)
    @network_options
    def command(key_path: str, reason: str, dht_prefix: str, trusted: tuple[str, ...], **options) -> None:
        network = _network(options)  # a malformed peer is refused before hivemind loads
        from swarm.dht.node import start_dht, stop_dht
        from swarm.dht.schema import protected_keys
        from swarm.governance.keys import public_key_text, public_keys_from_env
        from swarm.governance.records import publish

        key = _private_key(key_path)
        others = _parse_keys(trusted or tuple(public_keys_from_env()))
        signers = [public_key_text(k) for k in [key, *others]]
        dht = start_dht(network, protect=protected_keys(dht_prefix, governance_signers=signers))
        try:
            decision = publish(dht, key, dht_prefix, action, reason, trusted=others)
        finally:
            stop_dht(dht)
        if decision is None:
            raise CLIError("the record could not be read back from the swarm (no peer kept it, or the governance key "
                           "is flooded); readers do not see it: are the initial peers part of the swarm?",
                           EXIT_UNREACHABLE)
        click.echo(f"{describe(decision)} stored and read back for '{dht_prefix}'" + (f": {reason}" if reason else ""))

    command.__doc__ = {
        HALT: "Halt the swarm: servers refuse new steps, clients stop before their next step. Succeeds only once "
              "the record is read back from the swarm.",
        RESUME: "Resume a halted swarm (a decision with a higher sequence than the halt). Publish one once when "
                "setting up keys: servers and clients that trust keys stop when they read no decision for "
                "--governance-stale-after seconds (120 by default).",
    }[action]
    return main.command(name=action)(command)


_decision_command(HALT)
_decision_command(RESUME)


@main.command()
@click.option("--governance-key", "keys", multiple=True, required=True,
              help="Trusted public key (base64 or file; repeatable).")
@click.option("--dht-prefix", default="default", show_default=True, help=PREFIX_HELP)
@network_options
def status(keys: tuple[str, ...], dht_prefix: str, **options) -> None:
    """Print whether the swarm is halted according to records signed by the given keys ("no valid governance
    record" means servers and clients trusting these keys will stop after --governance-stale-after seconds:
    publish a resume)."""
    network = _network(options)  # a malformed peer is refused before hivemind loads
    from swarm.dht.node import start_dht, stop_dht
    from swarm.dht.schema import protected_keys
    from swarm.governance.keys import public_key_text
    from swarm.governance.records import GovernanceState

    trusted = _parse_keys(keys)
    state = GovernanceState(dht_prefix, trusted)
    signers = [public_key_text(k) for k in trusted]
    dht = start_dht(network, protect=protected_keys(dht_prefix, governance_signers=signers))
    try:
        decision = state.refresh(dht)
        for pause in STATUS_REREADS:  # a peer that has just joined may not reach the key's holders at once
            if decision is not None:
                break
            time.sleep(pause)
            decision = state.refresh(dht)
    finally:
        stop_dht(dht)
    if decision is None:
        click.echo("running (no valid governance record: servers and clients trusting these keys stop after "
                   "--governance-stale-after seconds; publish a resume)")
    else:
        click.echo(f"{'HALTED' if decision.halted else 'running'}: last {describe(decision)}"
                   + (f" ({decision.reason})" if decision.reason else ""))
    sys.exit(EXIT_HALTED if state.halted else 0)


if __name__ == "__main__":
    run_main(main)
