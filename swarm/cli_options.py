"""Click options shared by the commands that generate text or join the swarm (one definition, many commands).

The generation options are not written here: they are made from the declared settings of
:class:`~swarm.diffusion.config.GenerationConfig` and :class:`~swarm.lm.GenerationRequest` (name, type,
default, help text, bounds), so that a new setting gets its flag without touching this module.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import click
from click.core import ParameterSource

from swarm.dht.node import NetworkConfig
from swarm.diffusion.config import GenerationConfig, SettingField, settings_of
from swarm.lm import GenerationRequest


def cli_settings() -> tuple[SettingField, ...]:
    """The settings offered on the command line: the sampler's, then the request's, in declaration order."""
    return tuple(field for cls in (GenerationConfig, GenerationRequest) for field in settings_of(cls) if field.spec.cli)


GENERATION_KEYS = tuple(field.name for field in settings_of(GenerationConfig) if field.spec.cli)
REQUEST_KEYS = tuple(field.name for field in settings_of(GenerationRequest) if field.spec.cli)


class ExpertWeights(click.ParamType):
    """``auto`` or ``NAME=WEIGHT[,NAME=WEIGHT...]`` -> ``"auto"`` or ``{name: weight}``."""

    name = "auto|NAME=WEIGHT,..."

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> Any:
        if not isinstance(value, str) or value == "auto":
            return value
        weights = {}
        for part in value.split(","):
            name, equals, weight = part.partition("=")
            try:
                if not equals or not name.strip():
                    raise ValueError(part)
                weights[name.strip()] = float(weight)
            except ValueError:
                self.fail(f"expected 'auto' or NAME=WEIGHT pairs separated by commas, got {part!r}", param, ctx)
        return weights


def setting_option(field: SettingField) -> Callable[[Callable], Callable]:
    """The click option of one declared setting (``gen_length``: ``--gen-length``): type, default and help text
    from its declaration; booleans get ``--name/--no-name``."""
    flag = "--" + field.name.replace("_", "-")
    default = None if field.spec.computed_default else field.default
    common = dict(default=default, show_default=default is not None, help=field.describe(choices=False))
    if field.kind is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", field.name, **common)
    if field.spec.choices:
        return click.option(flag, field.name, type=click.Choice(list(field.spec.choices)), **common)
    if field.kind in (int, float, str):
        return click.option(flag, field.name, type=field.kind, **common)
    return click.option(flag, field.name, type=ExpertWeights(), **common)


def generation_options(command: Callable, fields: Optional[Iterable[SettingField]] = None) -> Callable:
    """Add an option for each generation setting (by default :func:`cli_settings`); they arrive as keyword
    arguments of the same names, for :func:`pop_generation_kwargs`."""
    for field in reversed(tuple(cli_settings() if fields is None else fields)):
        command = setting_option(field)(command)
    return command


def pop_generation_kwargs(options: dict[str, Any], keys: Iterable[str] = GENERATION_KEYS + REQUEST_KEYS) -> dict:
    """Take the generation options out of a command's keyword arguments: those the user gave.

    Options left at their default are left out, so ``generate`` applies its own defaults (the scale may then
    choose a Picard window, as it does for a Python caller).
    """
    ctx = click.get_current_context(silent=True)
    taken = {}
    for key in keys:
        value = options.pop(key, None)
        given = ctx.get_parameter_source(key) not in (None, ParameterSource.DEFAULT) if ctx else value is not None
        if given:
            taken[key] = value
    return taken


def require_no_options_left(options: dict[str, Any]) -> None:
    """Refuse options that reached no argument: a flag that would otherwise be silently ignored."""
    if options:
        raise click.UsageError(f"option(s) {', '.join(sorted(options))} reach no argument of this command "
                               "(a flag without a setting in swarm.diffusion.config or swarm.lm.GenerationRequest)")


def network_options(command: Callable) -> Callable:
    """Options of every command that joins the swarm; they build a :class:`~swarm.dht.node.NetworkConfig`."""
    options = [
        click.option("--initial-peers", multiple=True,
                     help="Multiaddr of a peer already in the swarm (repeatable). Default: $SWARM_INITIAL_PEERS, "
                          "then the bootstrap-list file ($SWARM_BOOTSTRAP_FILE or the packaged "
                          "swarm/bootstrap_peers.txt); none starts a new swarm."),
        click.option("--host-maddrs", multiple=True, default=["/ip4/127.0.0.1/tcp/0"], show_default=True,
                     help="Multiaddrs to listen on (repeatable); use /ip4/0.0.0.0/tcp/PORT to accept other machines."),
        click.option("--announce-maddrs", multiple=True,
                     help="Public multiaddrs to announce, e.g. behind port forwarding (repeatable)."),
        click.option("--identity-path", type=click.Path(dir_okay=False), default=None,
                     help="Private key file giving a persistent peer id; created on first use."),
        click.option("--use-relay/--no-relay", default=True, show_default=True,
                     help="Allow reaching and being reached through libp2p circuit relays."),
        click.option("--use-auto-relay", is_flag=True, default=False,
                     help="Look for relays to become reachable from behind NAT."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def pop_network_config(options: dict[str, Any], client_mode: bool = False) -> NetworkConfig:
    return NetworkConfig(
        initial_peers=list(options.pop("initial_peers")), host_maddrs=list(options.pop("host_maddrs")),
        announce_maddrs=list(options.pop("announce_maddrs")), identity_path=options.pop("identity_path"),
        use_relay=options.pop("use_relay"), use_auto_relay=options.pop("use_auto_relay"), client_mode=client_mode,
    )


def parse_span(text: str | None) -> tuple[int, int] | None:
    """``"0:16"`` -> (0, 16); a clear error for anything else."""
    if text is None:
        return None
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise click.BadParameter(f"expected START:END such as 0:16, got {text!r}") from None
    if not 0 <= start < end:
        raise click.BadParameter(f"expected 0 <= START < END, got {text!r}")
    return start, end
