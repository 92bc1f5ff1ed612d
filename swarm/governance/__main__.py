"""``python -m swarm.governance keygen | halt --reason ... | resume | status``: the swarm's kill switch."""
from __future__ import annotations

import logging
import sys

import click

from swarm.cli_options import network_options, pop_network_config
from swarm.governance.keys import (
    generate_private_key,
    load_private_key,
    parse_public_key,
    public_key_text,
    public_keys_from_env,
)
from swarm.governance.records import HALT, RESUME, GovernanceState, publish

PREFIX_HELP = "DHT prefix of the model to govern (servers' --dht-prefix; default: the embedded model's 'default')."


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Create a governance key, and halt or resume the swarm with records signed by it."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command()
@click.option("--out", "path", default="governance.key", show_default=True, type=click.Path(dir_okay=False),
              help="Where to write the private key (refuses to overwrite).")
def keygen(path: str) -> None:
    """Create an Ed25519 governance key and print its public half (give it to servers and clients)."""
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


def _parse_keys(texts: tuple[str, ...]) -> list:
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
        from swarm.dht.node import start_dht, stop_dht

        key = load_private_key(key_path)
        others = _parse_keys(trusted or tuple(public_keys_from_env()))
        dht = start_dht(pop_network_config(options, client_mode=True))
        try:
            decision = publish(dht, key, dht_prefix, action, reason, trusted=others)
        finally:
            stop_dht(dht)
        if decision is None:
            click.echo("the DHT did not accept the record (no reachable peers?)", err=True)
            sys.exit(1)
        click.echo(f"{action} #{decision.sequence} signed and stored for '{dht_prefix}'"
                   + (f": {reason}" if reason else ""))

    command.__doc__ = {HALT: "Halt the swarm: servers refuse new steps, clients stop before their next step.",
                       RESUME: "Resume a halted swarm (a decision with a higher sequence than the halt)."}[action]
    return main.command(name=action)(command)


_decision_command(HALT)
_decision_command(RESUME)


@main.command()
@click.option("--governance-key", "keys", multiple=True, required=True,
              help="Trusted public key (base64 or file; repeatable).")
@click.option("--dht-prefix", default="default", show_default=True, help=PREFIX_HELP)
@network_options
def status(keys: tuple[str, ...], dht_prefix: str, **options) -> None:
    """Print whether the swarm is halted according to records signed by the given keys."""
    from swarm.dht.node import start_dht, stop_dht

    state = GovernanceState(dht_prefix, _parse_keys(keys))
    dht = start_dht(pop_network_config(options, client_mode=True))
    try:
        decision = state.refresh(dht)
    finally:
        stop_dht(dht)
    if decision is None:
        click.echo("running (no valid governance record)")
    else:
        click.echo(f"{'HALTED' if decision.halted else 'running'}: last {decision.action} #{decision.sequence} "
                   f"at {decision.timestamp:.0f}" + (f" ({decision.reason})" if decision.reason else ""))
    sys.exit(3 if state.halted else 0)


if __name__ == "__main__":
    main()
