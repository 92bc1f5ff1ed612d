"""What every command line of the project shares (one definition, many commands).

* **Errors and exit codes.** Every command is a :class:`SwarmCommand` (or :class:`SwarmGroup`): an error it
  knows (a bad value, a port in use, a swarm it cannot reach, missing blocks, a halt) ends the command with one
  line saying what to change and an exit code from :data:`EXIT_CODES` (the table in docs/OPERATIONS.md);
  ``--verbose``, which every such command has, adds the traceback. Anything else is a bug: run as a program
  (:func:`run_main`) it is one line too, exit 70; called from Python, it raises as usual.
* **Threads.** ``--threads`` (:func:`threads_option`): torch's CPU threads, by default half of this machine's.
* **Options** to join the swarm (:func:`network_options`) and to generate. The generation options are not
  written here: they are made from the declared settings of :class:`~swarm.diffusion.config.GenerationConfig`
  and :class:`~swarm.frontend.lm.GenerationRequest` (name, type, default, help text, bounds), so that a new setting
  gets its flag without touching this module.
"""
from __future__ import annotations

import datetime
import logging
import sys
import traceback
from typing import Any, Callable, Iterable, Optional

import click
from click.core import ParameterSource

from swarm.dht.config import NetworkConfig
from swarm.dht.peers import check_peer_multiaddr
from swarm.diffusion.config import GenerationConfig
from swarm.frontend.request import GenerationRequest
from swarm.models.config import MODEL_DEFAULT_SETTINGS
from swarm.utils.errors import (
    EXIT_HALTED,
    EXIT_IN_USE,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_NOT_SERVED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    SwarmError,
)
from swarm.utils.extras import missing_extra_message
from swarm.utils.settings import SettingField, settings_of
from swarm.utils.text import listed
from swarm.utils.threads import THREADS_HELP, apply_threads, default_threads  # noqa: F401 (commands import them here)

# ----- exit codes and one-line errors -----------------------------------------------------------------
# Each error the project raises on purpose carries its code (SwarmError.exit_code); this is their documentation.
EXIT_CODES = {
    EXIT_OK: "success (swarm.health: every block has an online server)",
    EXIT_NOT_SERVED: "the model is not fully served: some block has no online server",
    EXIT_USAGE: "a bad command line or value (a flag, a multiaddr, a model path or a repo id whose files cannot be "
                "fetched, a key file), or an optional package missing: the message names it (and the extra to install)",
    EXIT_UNREACHABLE: "the swarm could not be joined: no initial peer could be reached",
    EXIT_IN_USE: "a port to listen on, or the identity key, is already used by another process",
    EXIT_HALTED: "the swarm is halted by governance (swarm.generate, swarm.governance status)",
    EXIT_INTERNAL: "an unexpected error (a bug): run again with --verbose and report the traceback",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}
VERBOSE_KEY = "swarm.verbose"
# Exceptions that mean "the user gave something wrong": bad values and files that are missing or unreadable.
USAGE_ERRORS = (ValueError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
                PermissionError)


class CLIError(click.ClickException):
    """One line for the user (``Error: ...``) and its exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_INTERNAL):
        super().__init__(" ".join(message.split()))  # one line, whatever the source wrapped
        self.exit_code = exit_code


def as_cli_error(error: BaseException) -> Optional[CLIError]:
    """The line and exit code of an error a command knows; None for anything else (a bug: see :func:`run_main`)."""
    if isinstance(error, KeyboardInterrupt):
        return CLIError("interrupted", EXIT_INTERRUPTED)
    if isinstance(error, SwarmError) and error.exit_code != EXIT_INTERNAL:
        return CLIError(str(error) or type(error).__name__, error.exit_code)
    if isinstance(error, USAGE_ERRORS):
        return CLIError(str(error) or type(error).__name__, EXIT_USAGE)
    missing = missing_extra_message(error) if isinstance(error, ImportError) else None
    if missing is not None:  # an optional package: the install line, not a bug report
        return CLIError(missing, EXIT_USAGE)
    return None


def _verbose_callback(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        ctx.meta[VERBOSE_KEY] = True


def verbose_option() -> click.Option:
    """``--verbose``: log at INFO level and print the traceback of an error (read with :func:`is_verbose`)."""
    return click.Option(["--verbose"], is_flag=True, expose_value=False, is_eager=True, callback=_verbose_callback,
                        help="Log at INFO level, and show the full traceback of an error.")


def is_verbose() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx and ctx.meta.get(VERBOSE_KEY))


class OneLineErrors:
    """Mixin for click commands: errors end as one line and a documented exit code (:func:`as_cli_error`), and the
    command gets ``--verbose`` (:func:`verbose_option`) unless it declares its own."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not any(param.name == "verbose" for param in self.params):
            self.params.append(verbose_option())

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as error:  # raised by the command itself: one line too, without the usage text
            raise CLIError(error.format_message(), error.exit_code) from error
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit):
            raise
        except (Exception, KeyboardInterrupt) as error:
            failure = as_cli_error(error)
            if failure is None:
                raise  # a bug: run_main makes it one line, callers in Python (tests) get the exception
            if ctx.meta.get(VERBOSE_KEY):
                traceback.print_exception(error, file=sys.stderr)
            raise failure from error


def run_main(command: click.Command) -> None:
    """``python -m swarm.X``: run ``command``; an error it does not know (a bug) ends as one line, exit 70, its
    traceback shown with --verbose, so that no mistake of the user or the program floods the terminal."""
    try:
        command.main()
    except Exception as error:
        if "--verbose" in sys.argv[1:]:
            traceback.print_exception(error, file=sys.stderr)
        failure = as_cli_error(error)  # a plain click command's known error (a missing extra): its line and code
        if failure is not None:
            failure.show()
            sys.exit(failure.exit_code)
        click.echo(f"Error: internal error: {type(error).__name__}: {' '.join(str(error).split())} (a bug: run "
                   "again with --verbose and report the traceback)", err=True)
        sys.exit(EXIT_INTERNAL)


class SwarmCommand(OneLineErrors, click.Command):
    """A command of the project (``@click.command(cls=SwarmCommand)``)."""


class SwarmGroup(OneLineErrors, click.Group):
    """A group of commands of the project; its subcommands are :class:`SwarmCommand`."""

    command_class = SwarmCommand


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET_LOGGERS = ("gensim", "smart_open")  # libraries whose INFO lines drown a command's own (unless --verbose)


def setup_logging(level: int | str) -> None:
    """Log at ``level`` (at least INFO with --verbose), keeping chatty libraries at WARNING."""
    numeric = logging.getLevelName(level) if isinstance(level, str) else level
    logging.basicConfig(level=min(numeric, logging.INFO) if is_verbose() else numeric, format=LOG_FORMAT)
    if not is_verbose():
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


def utc_time(timestamp: float) -> str:
    """Epoch seconds as a date a person reads: ``2026-12-01 18:15:05 UTC``."""
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def halt_message(halt: dict[str, Any]) -> str:
    """A governance halt (``result.info["halt"]``) as one sentence: why, who signed it and when, where it stopped."""
    signed = f", signed {utc_time(halt['signed_at'])}" if isinstance(halt.get("signed_at"), (int, float)) else ""
    sequence = f" #{halt['sequence']}" if "sequence" in halt else ""
    return (f"the swarm is halted by governance (halt{sequence}{signed}): {halt.get('reason') or 'no reason given'}; "
            f"generation stopped before step {halt.get('step')}. Retry once the swarm's operators resume it.")


# ----- threads -----------------------------------------------------------------------------------------
def threads_option(*flags: str, dest: str = "threads", help: str = THREADS_HELP) -> Callable[[Callable], Callable]:
    """``--threads`` (plus any other ``flags``), an int >= 1 or nothing; apply it with :func:`apply_threads`."""
    return click.option("--threads", *flags, dest, type=click.IntRange(min=1), default=None, show_default=False,
                        help=help)


# ----- options -----------------------------------------------------------------------------------------
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


def setting_option(field: SettingField, click_ranges: bool = False,
                   help_prefix: str = "") -> Callable[[Callable], Callable]:
    """The click option of one declared setting (``gen_length``: ``--gen-length``): names, type, default and help
    text from its declaration; booleans get ``--name/--no-name``, tuples a repeatable option.

    ``click_ranges`` makes click refuse numbers outside the declared bounds itself (and show them in ``--help``);
    without it the config's own validation refuses them, with the message a Python caller gets.
    """
    model_default = not click_ranges and field.name in MODEL_DEFAULT_SETTINGS
    default = None if field.spec.computed_default or model_default else field.default
    common: dict[str, Any] = dict(default=default, help=_help_text(field, click_ranges, model_default, help_prefix))
    if not click_ranges:
        common["show_default"] = default is not None
    flags = list(field.spec.flags) if field.spec.flags else [field.flag]
    if field.kind is bool:
        return click.option(f"{flags[0]}/--no-{flags[0][2:]}", *flags[1:], field.name, **common)
    return click.option(*flags, field.name, type=_click_type(field, click_ranges), multiple=field.repeated, **common)


def _help_text(field: SettingField, click_ranges: bool, model_default: bool, prefix: str) -> str:
    """An option's help: the declaration's text, bounds (unless click shows them) and how the default is chosen."""
    spec = field.spec
    text = field.describe(choices=False) if not click_ranges else " ".join(
        filter(None, [spec.help, spec.computed_default and f"Default: {spec.computed_default}."]))
    if model_default:  # the model's generation.json decides, else the declared default
        text += f" Default: model default (its generation.json), else {field.default}."
    first_word = text.split(" ", 1)[0]
    if prefix and first_word[:1].isupper() and (first_word[1:].islower() or len(first_word) == 1):
        text = text[0].lower() + text[1:]  # "With --initial-peers: servers pass ..."
    return prefix + text


def _click_type(field: SettingField, click_ranges: bool) -> Any:
    """The click type of a declared setting (see :func:`setting_option`)."""
    spec = field.spec
    if spec.choices:
        return click.Choice(list(spec.choices))
    if spec.directory:
        return click.Path(exists=True, file_okay=False)
    if click_ranges and spec.low is not None and not isinstance(spec.high, str):
        if field.kind is int:
            return click.IntRange(min=int(spec.low), max=None if spec.high is None else int(spec.high))
        return click.FloatRange(min=spec.low, max=spec.high, min_open=spec.low_open)
    if field.kind in (int, float, str):
        return field.kind
    if field.repeated:
        return str
    return ExpertWeights()


def config_options(cls: type, help_prefix: str = "") -> Callable[[Callable], Callable]:
    """Decorator: an option for each declared command-line setting of the config dataclass ``cls`` (a server's,
    a client's), bounds checked by click; the values arrive as keyword arguments named after the fields."""

    def decorate(command: Callable) -> Callable:
        for field in reversed([field for field in settings_of(cls) if field.spec.cli]):
            command = setting_option(field, click_ranges=True, help_prefix=help_prefix)(command)
        return command

    return decorate


def pop_config_kwargs(options: dict[str, Any], cls: type) -> dict[str, Any]:
    """Take the options of :func:`config_options` out of a command's keyword arguments: those the user gave."""
    return pop_generation_kwargs(options, [field.name for field in settings_of(cls) if field.spec.cli])


def generation_options(command: Callable, fields: Optional[Iterable[SettingField]] = None) -> Callable:
    """Add an option for each generation setting (by default :func:`cli_settings`); they arrive as keyword
    arguments of the same names, for :func:`pop_generation_kwargs`."""
    for field in reversed(tuple(cli_settings() if fields is None else fields)):
        command = setting_option(field)(command)
    return command


def gen_length_option(**kwargs: Any) -> Callable[[Callable], Callable]:
    """``--gen-length`` with its declared synonyms (``--max-new-tokens``), for commands that declare their own
    default and help: every command that generates accepts the same names as :class:`GenerationConfig`, and refuses
    the values it refuses (at least 1) before anything loads."""
    from swarm.diffusion.config import GenerationConfig
    from swarm.utils.settings import declared

    kwargs.setdefault("type", click.IntRange(min=1))
    return click.option(*declared(GenerationConfig, "gen_length").spec.flags, "gen_length", **kwargs)


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
    check_alone(taken)
    return taken


def check_alone(settings: dict[str, Any]) -> None:
    """Refuse a setting outside its declared bounds (``--gen-length 0``) now, before a command loads a model or joins
    a swarm: bounds that name another setting (``cache_refresh`` 0..``steps``) and the checks against the model are
    left to the config, which runs every check again."""
    fields = {field.name: field for cls in (GenerationConfig, GenerationRequest) for field in settings_of(cls)}
    for name, value in settings.items():
        field = fields.get(name)
        if field is not None and not isinstance(field.spec.high, str):
            field.check(value)


def require_no_options_left(options: dict[str, Any]) -> None:
    """Refuse options that reached no argument: a flag that would otherwise be silently ignored."""
    if options:
        reach = "reaches" if len(options) == 1 else "reach"
        raise click.UsageError(f"{listed('option', sorted(options))} {reach} no argument of this command (a flag "
                               "without a setting in swarm.diffusion.config or swarm.frontend.request)")


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
        click.option("--use-relay/--no-relay", default=None,
                     help="Allow reaching and being reached through libp2p circuit relays. Default: allowed, but in "
                          "a swarm on this machine only (listening on loopback, every initial peer on loopback), "
                          "where no peer is behind a NAT and a relay would only cost CPU."),
        click.option("--use-auto-relay", is_flag=True, default=False,
                     help="Look for relays to become reachable from behind NAT."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def pop_network_config(options: dict[str, Any], client_mode: bool = False) -> NetworkConfig:
    """The :class:`NetworkConfig` of :func:`network_options`; a malformed ``--initial-peers`` is refused here."""
    for peer in options["initial_peers"]:
        for part in peer.replace(",", " ").split():
            check_peer_multiaddr(part)
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
