"""Self-prompting (swarm/improve/self_prompt.py): the domains' checkers and proposal parser under hostile input, the
held-out guard, and a round with the embedded addition model (docs/TRAINING.md, "The swarm teaches itself")."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.improve.config import ImproveConfig
from swarm.improve.held_out import ContaminationError, refuse_contaminated
from swarm.improve.loop import Improver
from swarm.improve.self_prompt import SelfPromptConfig, SelfPrompter
from swarm.train.data import TASKS, AdditionTask, Problem

pytestmark = pytest.mark.unit
# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DOMAINS = [TASKS[name]() for name in ("addition", "tagged-addition", "bracketed-addition", "dotted-addition")]
ALL_DOMAINS = [task() for task in TASKS.values()]
operand = st.integers(0, 999)
# Respellings of a problem: other digits (fullwidth, Arabic-Indic), leading zeros, spaces anywhere.
DIGITS = {"ascii": "0123456789", "fullwidth": "０１２３４５６７８９"}


def spelt(number: int, digits: str, zeros: int) -> str:
    return digits[0] * zeros + "".join(digits[int(d)] for d in str(number))


@FUZZ
@given(a=operand, b=operand, answer=st.text(max_size=12))
def test_a_checker_accepts_the_one_right_answer_and_nothing_else(a, b, answer):
    for task in DOMAINS:
        right = task.solve(a, b)
        assert task.check(f"{a}+{b}=", right)
        assert task.check(f"{a}+{b}=", answer) == (answer == right)
        for malformed in (right + " ", " " + right, right + "\x00", "0" + right, right * 2, right[:-1],
                          right.replace("1", "１"), right + "\n", f"{right}{right[-1]}"):
            assert malformed == right or not task.check(f"{a}+{b}=", malformed), (task.name, malformed)


@FUZZ
@given(prompt=st.text(max_size=20), answer=st.text(max_size=12))
def test_a_checker_is_fooled_by_no_prompt_outside_the_tasks_problems(prompt, answer):
    for task in DOMAINS:
        if task.check(prompt, answer):  # then the prompt is a problem in the task's one spelling, answered right
            a, b = task.operands(prompt)
            assert prompt == f"{a}+{b}=" and a < 1000 and b < 1000 and answer == task.solve(a, b)


@pytest.mark.parametrize("prompt", ["012+5=", "12+05=", "１２+5=", "12 +5=", "12+5= ", "-1+5=", "1000+5=", "12+5",
                                    "+12+5=", "12++5=", "12+5==", "٣+4=", "12.0+5="])
def test_a_respelt_or_out_of_range_problem_is_no_problem_of_the_task(prompt):
    task = AdditionTask()
    assert task.operands(prompt) is None and not task.check(prompt, "17")


@FUZZ
@given(text=st.text(max_size=40) | st.from_regex(r"[0-9]{1,5}\+[0-9]{1,5}=.{0,6}", fullmatch=True))
def test_the_proposal_parser_names_a_problem_of_the_task_or_nothing(text):
    task = AdditionTask()
    proposal = task.parse_proposal(text)
    if proposal is not None:
        assert text.startswith(proposal) and task.operands(proposal) is not None


def test_the_proposal_parser_reads_a_completed_template():
    task = AdditionTask()
    assert task.parse_proposal("12+5=17") == "12+5="
    assert task.parse_proposal("12+5") is None and task.parse_proposal("12+0005=") is None


@FUZZ
@given(seed=st.integers(0, 2**31), zeros=st.integers(0, 3), digits=st.sampled_from(sorted(DIGITS)),
       spaces=st.booleans())
def test_every_spelling_of_a_held_out_problem_is_caught_and_no_training_problem_is(seed, zeros, digits, spaces):
    task = AdditionTask()
    held = task.problems(1, seed, held_out=True)[0]
    a, b = task.operands(held.prompt)
    gap = " " if spaces else ""
    respelt = f"{gap}{spelt(a, DIGITS[digits], zeros)}{gap}+{gap}{spelt(b, DIGITS[digits], zeros)}{gap}={gap}"
    assert task.would_contaminate(respelt), respelt
    assert not any(task.would_contaminate(p.prompt) for p in task.problems(20, seed, held_out=False))


def test_a_data_file_holding_a_held_out_problem_is_refused(tmp_path):
    """A round whose data would contaminate the held-out set is refused, by the trainer itself, before it trains: a
    hostile (or careless) writer of the data folder respells a held-out problem with a leading zero."""
    task = TASKS["tagged-addition"]()
    held = task.problems(1, 5, held_out=True)[0]
    a, b = task.operands(held.prompt)
    data = tmp_path / "data"
    data.mkdir()
    lines = [{"prompt": p.prompt, "response": p.answer} for p in task.problems(30, 1, held_out=False)]
    (data / "a.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = ImproveConfig(task="tagged-addition", data=str(data), name="n", key_path="k", workdir=str(tmp_path / "w"))
    improver = Improver(config, lm=None, dht=None, key=None, prefix="p", host=None)
    (data / "b.jsonl").write_text(json.dumps({"prompt": f"0{a}+{b}=", "response": held.answer}) + "\n")
    with pytest.raises(ContaminationError, match="held-out problems of tagged-addition"):
        improver.run_round()
    assert improver.state["round"] == 0 and improver.finetuner is None
    with pytest.raises(ContaminationError):
        refuse_contaminated(task, [f"{a} + {b} ="], "test")
    refuse_contaminated(task, [line["prompt"] for line in lines], "clean data")  # training problems pass


class HeldOutProposer(AdditionTask):
    """A hostile trainer's domain: every template it builds completes to a held-out problem."""

    name = "addition"

    def __init__(self):
        super().__init__()
        self.targets = iter(AdditionTask().problems(1000, 3, held_out=True))

    def proposal_template(self, seed: Problem, rng: random.Random) -> str:
        return next(self.targets).prompt

    def fill(self, template: str, seed: Problem, rng: random.Random) -> str:
        return template


@pytest.fixture(scope="module")
def addition_lm():
    from swarm.frontend.local import DiffusionLM

    return DiffusionLM.from_pretrained("addition")


def seeds_folder(tmp_path, task, count=4):
    folder = tmp_path / "data"
    folder.mkdir()
    seeds = task.problems(count, 0, held_out=False)
    (folder / "seeds.jsonl").write_text("".join(json.dumps({"prompt": p.prompt, "response": p.answer}) + "\n"
                                                for p in seeds))
    return folder


def test_a_trainer_that_proposes_held_out_problems_writes_none_of_them(tmp_path, addition_lm):
    task = HeldOutProposer()
    prompter = SelfPrompter(task, seeds_folder(tmp_path, task), tmp_path / "state.json",
                            SelfPromptConfig(proposals=6, model_proposals=False))
    record = prompter.run_round(addition_lm, adapter=None)
    assert (record.proposed, record.held_out, record.new, record.accepted) == (6, 6, 0, 0)
    assert (tmp_path / "data" / "self-0001.jsonl").read_text() == ""


def test_a_round_keeps_only_checked_answers_and_counts_what_it_saw_before(tmp_path, addition_lm):
    """The base addition model answers plain addition (many accepted) and never writes tagged addition's ``!`` (none
    accepted); proposals of a second round with the same randomness are all counted as seen."""
    accepted = {}
    for task in (TASKS["addition"](), TASKS["tagged-addition"]()):
        (tmp_path / task.name).mkdir()
        folder = seeds_folder(tmp_path / task.name, task)
        prompter = SelfPrompter(task, folder, tmp_path / task.name / "state.json",
                                SelfPromptConfig(proposals=8, model_proposals=task.name == "addition"))
        record = prompter.run_round(addition_lm, adapter=None)
        assert record.proposed == 8 and record.new + record.seen + record.held_out == 8
        kept = [json.loads(line) for line in (folder / "self-0001.jsonl").read_text().splitlines()]
        assert len(kept) == record.accepted
        assert all(task.check(pair["prompt"], pair["response"]) for pair in kept)
        assert prompter.seeds() == task.problems(4, 0, held_out=False), "the loop's own files are not seeds"
        accepted[task.name] = record.accepted
        prompter.state["round"] = 0  # the same round's randomness again: every proposal was seen
        again = prompter.run_round(addition_lm, adapter=None)
        assert again.new == 0 and again.seen == 8 - record.held_out
    assert accepted["addition"] >= 1 and accepted["tagged-addition"] == 0


@FUZZ
@given(prompt=st.text(max_size=14) | st.from_regex(r"[0-9]{6,9}\|[0-9]{1,2}=", fullmatch=True),
       answer=st.text(max_size=3) | st.integers(-1, 9).map(str))
def test_no_domain_checker_or_parser_is_fooled_by_any_text(prompt, answer):
    for task in ALL_DOMAINS:
        task.parse_proposal(prompt)
        task.would_contaminate(prompt)
        if task.check(prompt, answer):
            assert task.normalise(prompt) == prompt, (task.name, prompt)
            assert task.check(prompt, answer.strip()) and answer == answer.strip()


def test_the_host_blocks_checker_scores_the_built_in_rule_by_the_coverage_it_gives():
    """The network's own question: the rule (the server's --num-blocks choice) hosts blocks 4-6 of ``21030112`` and
    leaves block 2 with no server; the checker's answer, blocks 2-4, leaves none at zero. Over held-out questions the
    rule is right about 98 times in 100: a model has something to beat, and the checker says by how much."""
    from swarm.server.block_selection import least_covered_window

    task = TASKS["host-blocks"]()
    assert task.rule("21030112|3=") == "4" and not task.check("21030112|3=", "4")
    assert task.check("21030112|3=", "2")
    questions = task.problems(500, 9, held_out=True)
    right = sum(task.check(q.prompt, task.rule(q.prompt)) for q in questions)
    assert 400 < right < 500
    assert all(task.rule(q.prompt) == str(least_covered_window(*task.question(q.prompt))) for q in questions[:20])
    for malformed in ("2103011|3=", "21030112|9=", "21030112|0=", "２1030112|3=", "21030112|3", "21030112|03="):
        assert task.question(malformed) is None and not task.check(malformed, "2")
