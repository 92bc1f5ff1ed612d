"""``python -m swarm.advise --blocks N``: which blocks should a joining server host? The built-in rule's proposal
beside a ``host-blocks`` model's, each with the checker's verdict on this question and its score on held-out
questions; the rule stays the recommendation unless the model's audited score is higher (docs/OPERATIONS.md).

The question is the live health map of the swarm joined (``--initial-peers``, ``--model``), or one given by hand
(``--coverage 21030112``: servers per block; offline unless ``--initial-peers`` is given too). Exit codes as every
command's: 2 a bad command line (checked before any network starts), 3 the swarm could not be joined.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Optional

import click

from swarm.advise.config import DEFAULT_ADAPTER, MAX_BLOCKS, NONE, TASK
from swarm.cli.options import SwarmCommand, network_options, pop_network_config, run_main, setup_logging
from swarm.dht.config import NetworkConfig
from swarm.health.__main__ import client_network, read_map, resolve_target, target_options

if TYPE_CHECKING:
    from swarm.advise.advice import Question


def question_of_map(options: dict, model: Optional[str], dht_prefix: Optional[str], num_blocks: Optional[int],
                    blocks: int) -> tuple[Question, Optional[NetworkConfig], Optional[str]]:
    """The live map's question (the swarm is joined only after every argument is checked)."""
    network = client_network(options)
    prefix, num_blocks = resolve_target(model, dht_prefix, num_blocks)
    if blocks > num_blocks:
        raise click.BadParameter(f"{blocks} blocks of a model of {num_blocks}", param_hint="--blocks")
    health = read_map(network, prefix, num_blocks)
    from swarm.advise.advice import Question

    return Question(tuple(health.replicas), blocks, f"the live map of {prefix}"), network, prefix


def question_given(options: dict, coverage: str, model: Optional[str], dht_prefix: Optional[str],
                   blocks: int, adapter: str) -> tuple[Question, Optional[NetworkConfig], Optional[str]]:
    """A question given by hand; a swarm only with ``--initial-peers`` and an adapter (to look the adapter up and run
    it there)."""
    from swarm.advise.advice import Question, parse_coverage

    try:
        question = Question(parse_coverage(coverage), blocks, "given")
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    joins = bool(options["initial_peers"])
    network = pop_network_config(options, client_mode=True)  # a malformed peer is refused here either way
    if not joins or adapter == NONE:  # nothing to ask a swarm
        return question, None, None
    prefix, _ = resolve_target(model, dht_prefix, len(question.cover))
    return question, network, prefix


@click.command(cls=SwarmCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@network_options
@click.option("--blocks", type=click.IntRange(1, MAX_BLOCKS), required=True,
              help="How many consecutive blocks the joining server will host (its --num-blocks).")
@click.option("--coverage", default=None, help="Ask about this coverage instead of the live map's: online servers "
              "per block, one digit a block (21030112) or counts separated by commas (2,1,12,0). Offline unless "
              "--initial-peers is given too.")
@target_options
@click.option("--adapter", default=DEFAULT_ADAPTER, help=f"The model's proposal: {DEFAULT_ADAPTER} (the version of "
              f"the {TASK} task the trusted auditors scored best), a published NAME[@AUTHOR][@VERSION], a local "
              f"adapter folder, or '{NONE}' (the rule alone).")
@click.option("--trusted-auditors", "--trusted-auditor", "trusted_auditors", multiple=True,
              help="Auditor whose adapter scores count (base64 public key or a file holding one; repeatable). "
                   "Default: the governance keys ($SWARM_GOVERNANCE_KEYS); 'none' trusts no auditor.")
@click.option("--json", "as_json", is_flag=True, help="Print the advice as one JSON object instead of lines.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), default="WARNING",
              help="Logging verbosity.")
def main(blocks: int, coverage: Optional[str], model: Optional[str], dht_prefix: Optional[str],
         num_blocks: Optional[int], adapter: str, trusted_auditors: tuple[str, ...], as_json: bool, log_level: str,
         **options) -> None:
    """Which blocks should a joining server host: the built-in rule's proposal beside the host-blocks model's, each
    checked on this question and scored on held-out questions, and which one to follow."""
    setup_logging(log_level)
    from swarm.advise.advice import Advice, render_text, rule_proposal
    from swarm.advise.proposals import ModelSource, ask_model, check_adapter

    try:
        check_adapter(adapter)
    except ValueError as error:
        raise click.BadParameter(" ".join(str(error).split()), param_hint="--adapter") from None
    from swarm.reports.records import trusted_auditors as auditor_keys

    try:
        auditors = tuple(auditor_keys(trusted_auditors))
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--trusted-auditors") from None
    if coverage is not None:
        question, network, prefix = question_given(options, coverage, model, dht_prefix, blocks, adapter)
    else:
        question, network, prefix = question_of_map(options, model, dht_prefix, num_blocks, blocks)
    from swarm.models.loading import DEFAULT_MODEL

    source = ModelSource(adapter, model or DEFAULT_MODEL, network, prefix, auditors)
    model_proposal, missing = ask_model(question, source)
    advice = Advice(question, rule_proposal(question), model_proposal, missing)
    click.echo(json.dumps(advice.to_json(), indent=2) if as_json else "\n".join(render_text(advice)))


if __name__ == "__main__":
    run_main(main)
