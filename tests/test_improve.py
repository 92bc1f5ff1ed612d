"""The trainer role (python -m swarm.improve) and the self-improving loop's demonstration, shortened.

The demonstration test runs the whole loop (its own local swarm: a server, two trainers of one run id, an auditor,
a client) for 2 rounds of few steps and checks the table and that ``best:TASK`` moved to a version by audit alone.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from swarm.governance.keys import generate_private_key
from swarm.health.__main__ import main as health_main
from swarm.improve.__main__ import main as improve_main
from swarm.improve.demo import HEADER, round_of, run_demo, write_examples
from swarm.improve.loop import round_end

ROOT = Path(__file__).resolve().parents[1]


def test_every_flag_has_help_and_bad_input_is_one_line():
    for option in improve_main.params:
        if option.name != "help":
            assert getattr(option, "help", None), option.name
    result = CliRunner().invoke(improve_main, ["--task", "tagged-addition", "--data", "x", "--name", "n", "--key",
                                               __file__, "--workdir", "w", "--initial-peers", "/ip4/127.0.0.1/tcp/1",
                                               "--keep", "40"])
    assert result.exit_code == 2 and "--keep" in result.output


def start_trainer(local_swarm, tmp_path: Path, key: Path, data: Path, log: str):
    """``python -m swarm.improve`` forked from the swarm's fork server (its imports done), its output in ``log``."""
    peers = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
    command = ["-m", "swarm.improve", "--task", "tagged-addition", "--data", str(data),
               "--name", "resumed", "--key", str(key), "--workdir", str(tmp_path / "work"), "--rounds", "2",
               "--round-steps", "6", "--held-out", "4", "--batch-size", "8", "--keep", "1", "--local-model",
               "--threads", "1", *peers]
    return local_swarm.start_command("trainer", command, log=tmp_path / log).process


@pytest.mark.unit
def test_a_round_ends_round_steps_after_the_last_saved_one_wherever_the_kill_fell():
    """The resume test below once counted 18 steps instead of 12 under load: killed after its second round's training
    but before the round was saved, the trainer trained a third round's steps. Each place a kill can fall:"""
    assert round_end(0, 0, 6) == 6, "a first round"
    assert round_end(6, 9, 6) == 12, "killed mid-round: the round's remaining steps"
    assert round_end(6, 12, 6) == 12, "killed while measuring: no more steps, the round is measured again"
    assert round_end(6, 6, 6) == 12, "killed before its first step"
    assert round_end(6, 15, 6) == 21, "a collaboration went past the round while the trainer was away"


def test_a_trainer_resumes_after_a_kill_and_shows_its_versions(local_swarm, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_examples(data / "a.jsonl", 64, seed=3)
    key = tmp_path / "trainer.key"
    generate_private_key(key)
    trainer = start_trainer(local_swarm, tmp_path, key, data, "killed.log")
    try:
        deadline = time.monotonic() + 600
        while round_of(tmp_path / "work")[0] < 1:  # its first round is saved: kill it in the second
            assert trainer.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.log").read_text()[-3000:]
            time.sleep(0.1)
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=60)
        trainer = start_trainer(local_swarm, tmp_path, key, data, "resumed.log")
        assert trainer.wait(timeout=600) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(timeout=60)
    assert "resuming" in (tmp_path / "resumed.log").read_text()
    rounds, history = round_of(tmp_path / "work")
    assert rounds == 2 and [entry["round"] for entry in history] == [1, 2]
    assert history[-1]["steps"] == 12, "the second round went on from the saved optimizer state"
    kept = [p.name for p in (tmp_path / "work" / "versions").iterdir() if p.name.isdigit()]
    assert len(kept) <= 1, "bounded disk: --keep 1"
    peers = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
    health = CliRunner().invoke(health_main, ["--model", "addition", "--json", *peers])
    listed = [a for a in json.loads(health.stdout)["adapters"] if a["name"] == "resumed"]
    if any(entry["version"] for entry in history):  # a version beat the base model: the map shows it and the round
        assert listed and listed[0]["versions"] and listed[0]["training"]["round"] == 2


@pytest.mark.timeout(1500)
def test_the_shortened_demonstration_adopts_by_audit(tmp_path):
    # 10 optimizer steps a round (global batch 32): after the second round's 20 steps each trainer's own figure on
    # its 20 held-out problems was 4-10 of 20 in 12 seeds of a one-process run of the same schedule (0-6 of 20
    # after 10 steps), so a version is published by round 2 at the latest and the auditor scores it. The trainers
    # run the model in their own processes (--local-model): they still train together over the swarm's DHT, publish
    # and serve their versions there, and the auditor and the client still go through the server.
    # 10 audited problems a version: best:TASK adopts no version audited right on none (swarm.reports.adoption), and
    # a version right on a third of them answers none of 5 one time in 8, of 10 one time in 60.
    rows = run_demo(tmp_path, rounds=2, round_steps=10, held_out=20, audit_examples=10, client_examples=5,
                    batch_size=16, local_model=True, round_timeout=900)
    assert [row.round for row in rows] == [0, 1, 2]
    assert rows[0].client_score == 0.0 and rows[0].best == "-", "the base model never writes the tag"
    table = (tmp_path / "improve_demo.md").read_text().splitlines()
    assert table[:2] == HEADER.splitlines() and len(table) == 2 + len(rows)
    assert all(line.count("|") == 8 for line in table)
    plot = tmp_path / "improve_demo.png"
    if importlib.util.find_spec("matplotlib") is not None:  # the plot extra: the figure is drawn
        assert plot.stat().st_size > 1000
    else:  # the test extra alone: the table is the result and the missing figure is said, not an error
        assert not plot.exists()
    last = rows[-1]
    assert set(last.trainer_figures) == {"A", "B"}
    # Adoption by audit: best:TASK chose a trainer's version, which the trusted auditor scored.
    assert last.best.startswith("tagged@") and last.chosen_figure is not None


# ----- data sources ---------------------------------------------------------------------------------------------
def test_a_folder_source_grows_and_a_line_being_written_waits(tmp_path, monkeypatch):
    from swarm.improve import sources

    folder = tmp_path / "data"
    folder.mkdir()
    write_examples(folder / "a.jsonl", 3, seed=1)
    first = sources.DataSource(str(folder)).snapshot(tmp_path / "snap.jsonl")
    assert first.examples == 3
    (folder / "b.jsonl").write_text('{"prompt": "1+1=", "response": "2!"}\n{"prompt": "2+2=", "resp')
    grown = sources.DataSource(str(folder)).snapshot(tmp_path / "snap.jsonl")
    assert grown.examples == 4 and grown.sha256 != first.sha256, "the half-written line waits for its newline"
    monkeypatch.setattr(sources, "MAX_DATA_BYTES", 50)
    with pytest.raises(sources.SourceError, match="over 50 bytes"):
        sources.DataSource(str(folder)).snapshot(tmp_path / "snap.jsonl")
    with pytest.raises(sources.SourceError, match="no such file or folder"):
        sources.DataSource(str(tmp_path / "missing")).snapshot(tmp_path / "snap.jsonl")


def test_a_datasets_source_needs_the_package(tmp_path):
    import importlib.util

    from swarm.improve.sources import DataSource, SourceError

    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("the datasets package is installed here (reading one needs the network)")
    with pytest.raises(SourceError, match="the `datasets` package is not installed"):
        DataSource("datasets:some/name").snapshot(tmp_path / "snap.jsonl")


# ----- a really overfitted version, measured by a real auditor ---------------------------------------------------
OVERFIT_PREFIX = "improve-overfit"  # a prefix of its own for the embedded addition model


def trained(lm, directory: Path, problems, steps: int, lr: float, batch_size: int) -> Path:
    from swarm.finetune.config import FinetuneConfig
    from swarm.finetune.trainer import Finetuner

    directory.mkdir(parents=True)
    data = directory.parent / f"{directory.name}.jsonl"
    data.write_text("".join(json.dumps({"prompt": p.prompt, "response": p.answer}) + "\n" for p in problems))
    config = FinetuneConfig(data=str(data), output=str(directory), steps=steps, adapter_kind="lora", rank=4,
                            head_rank=8, lr=lr, batch_size=batch_size, pad_response=8)
    Finetuner(lm, config).run(progress=False)
    return directory


@pytest.mark.timeout(900)
def test_a_version_overfitted_to_its_public_examples_does_not_win(local_swarm, tmp_path):
    """Issue 49, item 3, with real training and a real auditor: a version trained on 4 public examples answers them
    all (its publisher's figure: 1.0, and it is the newest) and almost no fresh problem; a version trained on 300
    examples answers fresh problems better. The auditor measures both on fresh held-out problems, and a client trusting
    it gets the honest one from best:TASK."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from swarm.adapters.versions import publish_version
    from swarm.audit.auditor import Auditor
    from swarm.audit.config import AuditorConfig
    from swarm.dht.config import NetworkConfig
    from swarm.dht.node import start_dht, stop_dht
    from swarm.dht.validation import ed25519_text
    from swarm.eval.tasks import evaluate_task
    from swarm.frontend.local import DiffusionLM
    from swarm.models.loading import ModelFiles
    from swarm.train.data import Problem, TaggedAdditionTask
    from tests.conftest import stop_all, swarm_client

    local, task = DiffusionLM.from_pretrained("addition"), TaggedAdditionTask()
    public = task.problems(4, 7, held_out=False)
    honest = trained(local, tmp_path / "honest", task.problems(300, 1, held_out=False), 60, 0.003, 16)
    overfit = trained(local, tmp_path / "overfit", public, 60, 0.01, 4)

    class Public:
        name = "public"

        def problems(self, count: int, seed: int, held_out: bool) -> list[Problem]:
            return public

    claimed = evaluate_task(local, Public(), examples=4, generate_options={"adapter": str(overfit)})
    assert claimed.correct == 4, "the overfitted version answers its public examples"
    server = local_swarm.start_server("addition", "0:4", "--compute-threads", "1", "--dht-prefix", OVERFIT_PREFIX,
                                      "--serve-adapter", str(honest), "--serve-adapter", str(overfit))
    network = NetworkConfig(initial_peers=local_swarm.initial_peers, client_mode=True)
    dht = start_dht(network)
    auditor_key, trainer = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    try:
        data = "0" * 64
        good, _ = publish_version(dht, trainer, OVERFIT_PREFIX, honest, "tagged", data, 0.6, [server.peer_id])
        bad, _ = publish_version(dht, trainer, OVERFIT_PREFIX, overfit, "tagged", data, 1.0, [server.peer_id])
        # scoring is the point here, not the server's checks: no audit generation through it (32 calls, half of
        # them recomputed here), which tests/test_audit_traffic.py covers
        config = AuditorConfig(network=network, dht_prefix=OVERFIT_PREFIX, score_adapters=(task.name,),
                               task_examples=10, fresh_identity=False, once=True, generations=0)
        with Auditor(config, auditor_key, ModelFiles("addition"), dht=dht) as auditor:  # one DHT peer for both
            report = auditor.run_round().report
        scores = {entry.sha256: entry.correct for entry in report.adapters}
        # fresh problems tell them apart: on 6 draws of 20 the honest version answered 12-14, the overfitted one 0
        assert scores[bad.sha256] < scores[good.sha256], scores
        with swarm_client(local_swarm, "addition", dht=dht, dht_prefix=OVERFIT_PREFIX,
                          trusted_auditors=(ed25519_text(auditor_key),)) as lm:
            lm.adapter_cache = tmp_path / "cache"
            assert lm.best_adapter(task.name).endswith("@1"), "the honest version 1, not the newer overfitted 2"
    finally:
        stop_dht(dht)
        stop_all(local_swarm, [server])


def test_a_self_prompting_trainer_trains_on_the_answers_its_checker_accepted(local_swarm, tmp_path):
    """``--self-prompt``: round 1 trains on 8 seed examples alone; before round 2 the trainer proposes 8 problems,
    answers them with its adapter and writes only the answers the task's checker accepts, which round 2 trains on."""
    from swarm.train.data import TaggedAdditionTask

    data = tmp_path / "data"
    data.mkdir()
    write_examples(data / "seeds.jsonl", 8, seed=3)
    key = tmp_path / "trainer.key"
    generate_private_key(key)
    peers = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
    command = ["-m", "swarm.improve", "--task", "tagged-addition", "--data", str(data), "--name", "taught", "--key",
               str(key), "--workdir", str(tmp_path / "work"), "--rounds", "2", "--round-steps", "6", "--held-out", "4",
               "--batch-size", "8", "--self-prompt", "8", "--local-model", "--threads", "1", *peers]
    trainer = local_swarm.start_command("trainer", command, log=tmp_path / "trainer.log").process
    try:
        assert trainer.wait(timeout=600) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(timeout=60)
    rounds, history = round_of(tmp_path / "work")
    assert rounds == 2 and history[0]["self_prompt"] is None and history[0]["examples"] == 8
    record = history[1]["self_prompt"]
    assert record["proposed"] == 8 and record["new"] + record["seen"] + record["held_out"] == 8
    kept = [json.loads(line) for line in (data / "self-0001.jsonl").read_text().splitlines()]
    task = TaggedAdditionTask()
    assert len(kept) == record["accepted"] and all(task.check(p["prompt"], p["response"]) for p in kept)
    assert history[1]["examples"] == 8 + record["accepted"], "round 2 trained on the seeds and the accepted answers"
