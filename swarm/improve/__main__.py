"""``python -m swarm.improve --task TASK --data SOURCE --name NAME --key KEY --workdir DIR --initial-peers ...``:
the trainer role of the self-improving loop (swarm/improve/loop.py; docs/TRAINING.md, "The self-improving loop").
``python -m swarm.improve withdraw --name NAME --version N --key KEY`` withdraws a version (swarm/improve/withdraw.py).
``python -m swarm.improve coordinate --key KEY --stream NAME:TASK:WEIGHT ...`` publishes the signed stream records
(swarm/improve/coordinate.py).

Torch and hivemind are imported after the arguments are parsed, so that ``--help`` and a mistyped flag answer at once.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import click

from swarm.adapters.kinds import KINDS
from swarm.cli.options import SwarmCommand, apply_threads, run_main, setup_logging, threads_option
from swarm.dht.peers import split_peers
from swarm.improve.config import FALLBACK_MODEL, ImproveConfig
from swarm.train.config import TASK_NAMES

D = ImproveConfig  # the defaults


@click.command(cls=SwarmCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--task", required=True, type=click.Choice(TASK_NAMES),
              help="The held-out task of the trainer's own figure (auditors score versions on it too).")
@click.option("--data", required=True,
              help='Where the examples come from: a JSONL file ({"prompt": ..., "response": ...} per line), a folder '
                   "of *.jsonl files (re-read every round: files may be added or grow), or datasets:NAME[:SPLIT] (a "
                   "`datasets` dataset with prompt and response columns, where that package is installed).")
@click.option("--name", required=True, help="The adapter name this trainer publishes versions under.")
@click.option("--key", "key_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The publisher's Ed25519 private key (python -m swarm.governance keygen --out FILE makes one): only "
                   "it can publish or withdraw versions of its name.")
@click.option("--workdir", required=True, type=click.Path(file_okay=False),
              help="The run's directory: the adapter, its state, the kept versions, the libp2p identity. Rerunning the "
                   "same command resumes there (after a kill too).")
@click.option("--initial-peers", multiple=True, required=True,
              help="Multiaddr of a swarm peer (repeatable): the swarm to train through and publish on.")
@click.option("--model", default=None, show_default=False,
              help="Embedded model name or checkpoint directory (the frozen base). Default: the embedded model the "
                   f"swarm's servers hold (said at start), else {FALLBACK_MODEL}.")
@click.option("--dht-prefix", default=None, help="DHT namespace of the model (default: the model directory's name).")
@click.option("--run-id", default=None,
              help="Train together with every trainer of this run id (hivemind.Optimizer over the DHT).")
@click.option("--target-batch-size", type=click.IntRange(min=1), default=None,
              help="With --run-id: samples of all trainers per optimizer step (default: --batch-size).")
@click.option("--rounds", type=click.IntRange(min=0), default=D.rounds, help="Rounds to run; 0 runs until stopped.")
@click.option("--round-steps", type=click.IntRange(min=1), default=D.round_steps,
              help="Optimizer steps per round (between two held-out figures).")
@click.option("--keep", type=click.IntRange(1, 16), default=D.keep,
              help="Versions kept on disk and listed on the swarm (older ones are dropped).")
@click.option("--held-out", type=click.IntRange(min=1, max=10_000), default=D.held_out,
              help="Held-out problems of the trainer's own figure (the same ones every round).")
@click.option("--eval-seed", type=int, default=D.eval_seed, help="Which held-out problems the own figure uses.")
@click.option("--min-new-examples", type=click.IntRange(min=0), default=D.min_new_examples,
              help="Start a round only once the source holds this many examples more than the last round trained on "
                   "(0: round after round on whatever it holds).")
@click.option("--min-gain", type=click.FloatRange(0, 1), default=D.min_gain,
              help="Publish a version only when its figure beats the last published one by more than this.")
@click.option("--adapter-kind", type=click.Choice(KINDS), default=D.adapter_kind, help="The adapter trained.")
@click.option("--rank", type=click.IntRange(1, 256), default=D.rank, help="A LoRA's or bottleneck's rank.")
@click.option("--head-rank", type=click.IntRange(0, 256), default=D.head_rank,
              help="Rank of a correction of the output head (0: none).")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=D.lr, help="Adam learning rate.")
@click.option("--batch-size", type=click.IntRange(1, 1024), default=D.batch_size, help="Examples per batch.")
@click.option("--pad-response", type=click.IntRange(0, 4096), default=D.pad_response,
              help="EOS-pad every response to at least this many tokens (the generation length answers use).")
@click.option("--seed", type=int, default=D.seed,
              help="Seed of the adapter's first values and of the batches (trainers of one run use one seed).")
@click.option("--request-timeout", type=click.FloatRange(min=1), default=D.request_timeout,
              help="Seconds a call to a server may take.")
@click.option("--self-prompt", type=click.IntRange(min=0), default=D.self_prompt,
              help="Self-prompting (expert iteration): before each round after the first, propose this many new "
                   "problems of --task from the seed examples in --data (a folder), answer them with the adapter so "
                   "far, and add the answers the task's checker accepts to --data (0: off).")
@click.option("--stream-coordinator", default=None,
              help="Follow this stream coordinator's signed records (base64 public key or a file holding one): before "
                   "each round, train the stream it assigns this node, among this trainer's own and --also-stream's.")
@click.option("--also-stream", "also_streams", multiple=True,
              help="With --stream-coordinator: another stream this trainer can be moved to, NAME:TASK:DATA "
                   "(repeatable; its own workdir is WORKDIR/streams/NAME).")
@click.option("--round-per-record", is_flag=True,
              help="With --stream-coordinator: start a round only on a record of the coordinator newer than the one "
                   "the last round followed (the coordinator paces the rounds: one round per record).")
@click.option("--local-model", is_flag=True,
              help="Run the whole model here; the swarm then serves only the collaboration and the publishing.")
@threads_option()
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING"]), default="INFO",
              help="Logging verbosity (INFO logs every round's figures).")
def main(key_path: str, initial_peers: tuple[str, ...], threads, log_level: str, **options) -> None:
    """Train an adapter through the swarm round after round from a data source, and publish a new version of it
    whenever its own held-out figure beats the last published one (docs/TRAINING.md)."""
    setup_logging(getattr(logging, log_level))
    peers = split_peers(initial_peers, "--initial-peers")
    config = ImproveConfig(key_path=key_path, initial_peers=peers, **options)
    try:
        config.validate()
        if config.stream_coordinator is not None:
            config.stream_coordinator = coordinator_key(config.stream_coordinator)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    from swarm.finetune.publish import author_key

    key = author_key(key_path)
    apply_threads(threads)
    run(config, key)


def run(config: ImproveConfig, key) -> None:
    """Join the swarm, serve and publish versions, train round after round; leaves everything it started."""
    from swarm.dht.config import NetworkConfig
    from swarm.dht.identity import Identity
    from swarm.dht.node import start_dht, stop_dht
    from swarm.dht.schema import default_prefix, protected_keys
    from swarm.improve.hosting import VersionHost
    from swarm.improve.loop import Improver
    from swarm.models.loading import ModelFiles, embedded_models

    workdir = Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    candidates = {name: ModelFiles(name) for name in ([config.model] if config.model else embedded_models())}
    prefixes = {name: config.dht_prefix or default_prefix(files.path) for name, files in candidates.items()}
    identity = Identity.load_or_create(workdir / "identity.key")  # the same peer id after a restart
    dht = start_dht(NetworkConfig(config.initial_peers, use_default_peers=False), identity=identity,
                    protect=[key for prefix in prefixes.values() for key in protected_keys(
                        prefix, coordinators=[config.stream_coordinator] if config.stream_coordinator else [])])
    lm = improver = host = None
    try:
        if config.model is None:
            config = dataclasses.replace(config, model=model_of_swarm(dht, candidates, prefixes))
        files, prefix = candidates[config.model], prefixes[config.model]
        if config.local_model:
            from swarm.frontend.local import DiffusionLM

            lm = DiffusionLM.from_pretrained(config.model)
        else:
            from swarm.client import DistributedDiffusionLM

            lm = DistributedDiffusionLM.from_pretrained(config.model, initial_peers=config.initial_peers, dht=dht,
                                                        request_timeout=config.request_timeout, dht_prefix=prefix)
        host = VersionHost(dht, identity, prefix, files.config.hidden_size, config.host_lifetime)
        if config.stream_coordinator is None:
            improver = Improver(config, lm, dht, key, prefix, host)
        else:
            from swarm.improve.follow import Follower
            from swarm.improve.stream_records import read_streams

            improver = Follower(config, lambda settings: Improver(settings, lm, dht, key, prefix, host),
                                lambda: read_streams(dht, prefix, config.stream_coordinator), str(dht.peer_id))
        improver.run()
    finally:
        try:
            if improver is not None:
                improver.close()
            if host is not None:  # also when the improver failed to start (it closes the host it got)
                host.close()
            if lm is not None and hasattr(lm, "shutdown"):
                lm.shutdown()
        finally:
            stop_dht(dht)  # and the connection to its daemon that the client shares


def coordinator_key(text: str) -> str:
    """The one coordinator key (base64) of ``--stream-coordinator``; ValueError naming what is wrong."""
    from swarm.reports.records import trusted_auditors

    keys = trusted_auditors([text]) if text != "none" else []
    if len(keys) != 1:
        raise ValueError(f"--stream-coordinator {text[:80]!r}: one Ed25519 public key (base64) or a file holding one")
    return keys[0]


def model_of_swarm(dht, candidates: dict, prefixes: dict[str, str]) -> str:
    """The embedded model the swarm's servers hold (said on stderr, with how to choose another)."""
    from swarm.dht.served import choose_served, served_blocks

    sizes = {name: files.config.num_layers for name, files in candidates.items()}
    served = served_blocks(dht, {name: (prefixes[name], sizes[name]) for name in candidates})
    chosen = choose_served(served, sizes, FALLBACK_MODEL)
    if chosen is None:
        click.echo(f"model: {FALLBACK_MODEL} (no server of an embedded model was found on the swarm; --model to "
                   "choose)", err=True)
        return FALLBACK_MODEL
    others = sorted(name for name, blocks in served.items() if blocks and name != chosen)
    also = f"; it also serves {', '.join(others)}" if others else ""
    click.echo(f"model: {chosen} (the embedded model the swarm's servers hold{also}; --model to choose)", err=True)
    return chosen


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["withdraw"]:  # python -m swarm.improve withdraw --name NAME --version N --key KEY
        from swarm.improve.withdraw import withdraw_main

        sys.argv.pop(1)
        run_main(withdraw_main)
    elif sys.argv[1:2] == ["coordinate"]:  # python -m swarm.improve coordinate --key KEY --stream NAME:TASK:W ...
        from swarm.improve.coordinate import coordinate_main

        sys.argv.pop(1)
        run_main(coordinate_main)
    else:
        run_main(main)
