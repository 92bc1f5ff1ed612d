"""The streams demonstration's logic (swarm/improve/streams_report.py, swarm/improve/streams_demo.py), in process: the
weight schedule, which stream each node trained between two rows and its self-prompting, the pools the coordinator's
records give the nodes as the weights change, the table and the plot. The demonstration itself is a command
(``python -m swarm.improve.streams_demo``, docs/TRAINING.md), not a test: it runs for minutes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from swarm.improve import streams_report as report
from swarm.improve.coordinator import StreamSpec, plan_record
from swarm.improve.demo import write_report
from swarm.improve.streams_demo import REWEIGH, STREAMS, DemoConfig, main, make_nodes, node_command
from swarm.improve.streams_report import Progress, Reweigh, StreamRow, progress, weights_at

pytestmark = pytest.mark.unit

SPECS = (StreamSpec("tagged", "tagged-addition", 1.0), StreamSpec("hosts", "host-blocks", 1.0))


def test_reweigh_parses_and_refuses_what_is_not_round_name_weight():
    assert Reweigh.parse("3:tagged:2.5") == Reweigh(3, "tagged", 2.5)
    for bad in ("3:tagged", "x:tagged:1", "0:tagged:1", "3:tag ged:1", "3:tagged:-1", "3:tagged:1e9", "3:tagged:1:2"):
        with pytest.raises(ValueError):
            Reweigh.parse(bad)


def test_weights_change_from_the_round_a_reweigh_names():
    changes = (Reweigh(4, "hosts", 0.0), Reweigh(2, "tagged", 3.0))
    assert [s.weight for s in weights_at(SPECS, changes, 1)] == [1.0, 1.0]
    assert [s.weight for s in weights_at(SPECS, changes, 2)] == [3.0, 1.0]
    assert [s.weight for s in weights_at(SPECS, changes, 5)] == [3.0, 0.0]
    with pytest.raises(ValueError, match="no stream 'other'"):
        DemoConfig(Path("x"), SPECS, (Reweigh(2, "other", 1.0),)).validate()
    with pytest.raises(ValueError, match="one node per stream"):
        DemoConfig(Path("x"), SPECS, (), nodes=1).validate()


def test_the_default_run_has_two_addition_styles_and_the_networks_question_and_moves_one_node():
    """The defaults are what the measured run used (docs/TRAINING.md): two house styles of addition that the embedded
    model learns from its seeds (bracketed addition does not: it never starts), ``host-blocks`` for the advise
    comparison, pools of 2 1 1 that become 1 2 1 when ``dotted``'s weight rises."""
    specs = tuple(StreamSpec.parse(s) for s in STREAMS)
    reweighs = tuple(Reweigh.parse(r) for r in REWEIGH)
    DemoConfig(Path("x"), specs, reweighs).validate()
    assert [spec.task for spec in specs] == ["tagged-addition", "dotted-addition", "host-blocks"]
    nodes, record = [f"Qm{i}" for i in range(1, DemoConfig.nodes + 1)], None
    pools = []
    for number in (1, 2, 3):
        record = plan_record("addition", weights_at(specs, reweighs, number), {}, nodes, {}, number, 1.0, record)
        pools.append({entry.name: len(entry.pool) for entry in record.entries})
    assert pools[0] == pools[1] == {"tagged": 2, "dotted": 1, "hosts": 1}
    assert pools[2] == {"tagged": 1, "dotted": 2, "hosts": 1}


def save_history(workdir: Path, rounds: list[tuple[int, int]]) -> None:
    """An improve.json whose rounds recorded (new, accepted) self-prompting (the first: none, the seeds alone)."""
    workdir.mkdir(parents=True, exist_ok=True)
    history = [{"round": i + 1, "figure": 0.0,
                "self_prompt": None if i == 0 else {"new": new, "accepted": accepted}}
               for i, (new, accepted) in enumerate(rounds)]
    (workdir / "improve.json").write_text(json.dumps({"round": len(history), "history": history}))


def test_progress_credits_each_stream_with_the_rounds_its_nodes_finished_since_the_last_row(tmp_path):
    streams = ["tagged", "hosts"]
    one, two = tmp_path / "one", tmp_path / "two"  # one's own stream is tagged, two's is hosts
    save_history(one, [(0, 0), (30, 6)])
    save_history(two, [(0, 0)])
    first = {"one": report.node_histories(one, "tagged", streams), "two": report.node_histories(two, "hosts", streams)}
    assert {label: report.rounds_done(h) for label, h in first.items()} == {"one": 2, "two": 1}
    found = progress({}, first, streams)
    assert (found["tagged"].nodes, found["tagged"].new, found["tagged"].accepted) == (["one"], 30, 6)
    assert found["hosts"].nodes == ["two"] and found["hosts"].acceptance is None  # the seeds alone: no proposals
    before = report.done_counts(first)
    save_history(one, [(0, 0), (30, 6), (28, 7)])  # one more tagged round on one,
    save_history(one / "streams" / "hosts", [(0, 0)])  # then one moved to hosts (its run kept under streams/)
    save_history(two, [(0, 0), (31, 10)])
    later = {"one": report.node_histories(one, "tagged", streams), "two": report.node_histories(two, "hosts", streams)}
    found = progress(before, later, streams)
    assert (found["tagged"].nodes, found["tagged"].new, found["tagged"].accepted) == (["one"], 28, 7)
    assert (found["hosts"].nodes, found["hosts"].new, found["hosts"].accepted) == (["one", "two"], 31, 10)
    assert found["hosts"].acceptance == pytest.approx(10 / 31)
    assert report.rounds_done(later["one"]) == 4
    assert progress(report.done_counts(later), later, streams)["hosts"].nodes == [], "nothing new: nobody trained"


def test_nodes_start_on_the_first_records_pools_and_one_moves_when_a_weight_rises(tmp_path):
    config = DemoConfig(tmp_path, SPECS, (Reweigh(3, "tagged", 3.0),), nodes=4, seeds=5)
    nodes = make_nodes(config, tmp_path, "addition")
    ids = [node.peer_id for node in nodes]
    first = plan_record("addition", weights_at(SPECS, config.reweighs, 1), {}, ids, {}, 1, 1.0)
    assert {n.peer_id: n.own.name for n in nodes} == first.assignment()
    assert sorted(len(entry.pool) for entry in first.entries) == [2, 2]
    for node in nodes:  # each node holds seeds of every stream, and nothing else, in its own folders
        for spec in SPECS:
            lines = (node.workdir / f"seeds-{spec.name}" / "seeds.jsonl").read_text().splitlines()
            assert len(lines) == 5 and all(json.loads(line)["response"] for line in lines)
    second = plan_record("addition", weights_at(SPECS, config.reweighs, 2), {}, ids, {}, 2, 2.0, first)
    assert second.assignment() == first.assignment(), "no weight changed: nobody moves"
    third = plan_record("addition", weights_at(SPECS, config.reweighs, 3), {}, ids, {}, 3, 3.0, second)
    pools = {entry.name: len(entry.pool) for entry in third.entries}
    assert pools == {"tagged": 3, "hosts": 1}
    moved = [peer for peer in ids if third.assignment()[peer] != second.assignment()[peer]]
    assert len(moved) == 1 and third.assignment()[moved[0]] == "tagged", "only the surplus moves"
    command = node_command(nodes[0], 1, config, tmp_path / "coordinator.key.pub", ["/ip4/127.0.0.1/tcp/1/p2p/x"])
    other = next(spec for spec in SPECS if spec != nodes[0].own)
    assert command[command.index("--name") + 1] == nodes[0].own.name
    assert command[command.index("--also-stream") + 1].startswith(f"{other.name}:{other.task}:")
    assert command[command.index("--stream-coordinator") + 1] == str(tmp_path / "coordinator.key.pub")
    assert command[command.index("--threads") + 1] == "1" and "--self-prompt" in command


def rows() -> list[StreamRow]:
    return [StreamRow(0, "tagged", "tagged-addition", 1.0, ["n1", "n2"], [], None, 0, 0, 0, "-", None),
            StreamRow(0, "hosts", "host-blocks", 1.0, ["n3", "n4"], [], None, 0, 0, 0, "-", None),
            StreamRow(1, "tagged", "tagged-addition", 3.0, ["n1", "n2", "n3"], ["n1", "n2"], 0.25, 2, 0, 0,
                      "tagged@n2:v1", 0.25),
            StreamRow(1, "hosts", "host-blocks", 1.0, ["n4"], ["n3", "n4"], 0.5, 2, 40, 10, "hosts@n4:v1", 0.5,
                      flags=["claim refused: stream 'hosts' claims 1 node(s) not in its pool: x"])]


ADVICE = {"question": {"coverage": [2, 1, 0, 3, 0, 1, 1, 2], "blocks": 3, "source": "given", "prompt": "21030112|3="},
          "rule": {"who": "least_covered_window", "answer": "4", "start": 4, "right": False, "best_start": 2,
                   "score": {"correct": 972, "examples": 1000, "score": 0.972, "by": "the checker"}},
          "model": {"who": "hosts@A@2", "answer": "0", "start": 0, "right": False, "best_start": 2,
                    "score": {"correct": 20, "examples": 40, "score": 0.5, "by": "auditor"}},
          "missing": None, "recommended": "rule", "why": "the model's audited score 0.500 is not above the rule's"}


def test_the_table_shows_each_streams_pool_work_curve_adoption_and_acceptance_and_the_advice():
    text = report.table(rows(), ADVICE)
    lines = text.splitlines()
    assert lines[0].startswith("| round | stream (task) | weight | pool")
    assert "| 1 | tagged (tagged-addition) | 3 | 3: n1 n2 n3 | n1 n2 | 0.25 (2) | tagged@n2:v1 | 0.25 | - | - | - |" \
        in lines
    hosts = next(line for line in lines if line.startswith("| 1 | hosts"))
    assert "| 1: n4 FLAGGED: claim refused" in hosts and hosts.endswith("| 40 | 10 | 0.25 |")
    assert "| rule: least_covered_window | '4' | 4 | no (best: 2) | 972/1000 = 0.972 |" in text
    assert "| model: hosts@A@2 | '0' | 0 | no (best: 2) | 20/40 = 0.500 |" in text
    assert "Recommended: the rule" in text
    assert "none: no stream" in report.advice_table({**ADVICE, "model": None, "missing": "no stream"})
    assert "No advice asked" in report.advice_table(None)
    assert report.summary(rows()) == ["tagged: audited 0.25 (round 1) -> 0.25 (round 1); pools 2 3",
                                      "hosts: audited 0.50 (round 1) -> 0.50 (round 1); pools 2 1"]


def test_the_outputs_are_the_table_the_json_and_a_plot_or_the_line_saying_why_not(tmp_path):
    def no_matplotlib(path: Path) -> None:
        raise ImportError("matplotlib")

    said = write_report(tmp_path / "a", "streams_demo", report.table(rows(), ADVICE), {"rows": 4}, no_matplotlib)
    assert "no plot (matplotlib is not installed" in said and "streams_demo.md" in said
    assert (tmp_path / "a" / "streams_demo.md").read_text().startswith(report.HEADER)
    assert json.loads((tmp_path / "a" / "streams_demo.json").read_text()) == {"rows": 4}
    assert not (tmp_path / "a" / "streams_demo.png").exists()
    pytest.importorskip("matplotlib")
    said = write_report(tmp_path / "b", "streams_demo", "t", {}, lambda path: report.plot(rows(), ADVICE, path))
    assert said.endswith("streams_demo.png")
    assert (tmp_path / "b" / "streams_demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_stream_with_no_rounds_has_no_acceptance():
    assert Progress().acceptance is None
    assert StreamRow(1, "s", "t", 1.0, [], [], None, 0, 0, 0, "-", None).line().endswith("| - | - | - |")


@pytest.mark.parametrize("args, said", [
    (["--reweigh", "3:nope:1"], "--reweigh: no stream 'nope'"), (["--reweigh", "x"], "ROUND:NAME:WEIGHT"),
    (["--stream", "x:y"], "NAME:TASK:WEIGHT"), (["--stream", "a:no-such-task:1"], "--stream: no task 'no-such-task'"),
    (["--nodes", "1"], "--nodes: at least one node per stream"),
    (["--stream", "a:tagged-addition:1", "--stream", "a:host-blocks:1"], "each stream name once")])
def test_bad_input_is_one_line_and_exit_2_before_any_swarm_starts(tmp_path, args, said):
    result = CliRunner().invoke(main, ["--output", str(tmp_path / "out"), *args])
    assert result.exit_code == 2 and said in result.output, result.output
    assert not (tmp_path / "out").exists(), "nothing was started or written"
