"""``python -m swarm.advise``: the rule's proposal beside a host-blocks model's, each judged by the checker and scored
on held-out questions; the rule stays the recommendation unless the model's audited score is higher (issue 57)."""
from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.advise.__main__ import main
from swarm.advise.advice import Advice, Proposal, Question, Score, judge, parse_coverage, rule_proposal, rule_score
from swarm.advise.proposals import SETTINGS, audited
from swarm.train.data import HostBlocksTask


def advise(*args: str):
    return CliRunner().invoke(main, list(args))


def test_the_offline_form_shows_the_rule_checked_and_scored():
    result = advise("--coverage", "21030112", "--blocks", "3", "--adapter", "none", "--json")
    assert result.exit_code == 0, result.output
    advice = json.loads(result.stdout)
    rule = advice["rule"]
    assert (rule["who"], rule["start"], rule["best_start"], rule["right"]) == ("least_covered_window", 4, 2, False)
    assert rule["coverage_after"] == [2, 1, 0, 3, 1, 2, 2, 2] and rule["weakest_after"] == 0
    task = HostBlocksTask()
    problems = task.problems(1000, 0, held_out=True)
    assert rule["score"]["correct"] == sum(task.check(p.prompt, task.rule(p.prompt)) for p in problems)
    assert rule["score"]["examples"] == 1000
    assert (advice["model"], advice["missing"], advice["recommended"]) == (None, "--adapter none", "rule")
    text = advise("--coverage", "21030112", "--blocks", "3")
    assert text.exit_code == 0 and "give --initial-peers" in text.output, "best: needs a swarm: said in one line"
    assert "recommended: the rule, blocks 4-6" in text.output


@pytest.mark.parametrize("args, says", [
    (["--coverage", "2103x112", "--blocks", "3"], "whole numbers"),
    (["--coverage", "", "--blocks", "1"], "1-1024 blocks"),
    (["--coverage", "2,1,99999999", "--blocks", "1"], "whole numbers"),
    (["--coverage", "21030112", "--blocks", "9"], "1 to 8 blocks"),
    (["--coverage", "21030112", "--blocks", "3", "--adapter", "best:addition"], "only best:host-blocks"),
    (["--coverage", "21030112", "--blocks", "3", "--adapter", "no/such/folder"], "no such folder"),
    (["--coverage", "21030112", "--blocks", "3", "--adapter", "a@b@c@d"], "NAME@AUTHOR@VERSION"),
    (["--coverage", "21030112", "--blocks", "3", "--trusted-auditors", "xyz"], "Ed25519"),
    (["--blocks", "3", "--initial-peers", "garbage"], "multiaddr"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_network(args, says):
    result = advise(*args)
    assert result.exit_code == 2, result.output
    assert says in result.output and len(result.output.strip().splitlines()) == 1, result.output


# 100 examples, hypothesis's default: each run draws new ones, so runs add up (docs/TESTING.md "Budgets")
@settings(max_examples=100, deadline=None)
@given(cover=st.lists(st.integers(0, 9), min_size=8, max_size=8), span=st.integers(1, 8),
       answer=st.text(max_size=3) | st.integers(-2, 10).map(str))
def test_the_verdict_is_the_checker_s(cover, span, answer):
    question = Question(tuple(cover), span, "given")
    verdict = judge(question, answer)
    assert verdict.right == HostBlocksTask().check(question.prompt, answer)
    if verdict.start is not None:
        assert sum(verdict.after) == sum(cover) + span


def test_counts_over_nine_are_asked_as_nine_and_judged_as_they_are():
    question = Question(parse_coverage("12,0,3,0,0,1,1,2"), 2, "given")
    assert question.prompt == "90300112|2="
    assert judge(question, "3").after == (12, 0, 3, 1, 1, 1, 1, 2)
    assert Question(parse_coverage("2103"), 2, "given").prompt is None, "a 4-block model is not the task's question"


def test_the_rule_stays_recommended_unless_the_model_is_audited_higher():
    question = Question((2, 1, 0, 3, 0, 1, 1, 2), 3, "given")
    rule = rule_proposal(question, Score(97, 100, "the checker"))
    model = Proposal("hb@0123456789abcdef@2", "2", judge(question, "2"), None)
    assert Advice(question, rule, model).recommended is rule, "not audited: the rule"
    for correct, chosen in ((96, "rule"), (97, "rule"), (98, "model")):
        scored = Proposal(model.who, model.answer, model.verdict, Score(correct, 100, "an auditor"))
        advice = Advice(question, rule, scored)
        assert advice.recommended is (scored if chosen == "model" else rule), correct
        assert advice.to_json()["recommended"] == chosen and advice.to_json()["recommended_start"] == (
            2 if chosen == "model" else 4)


def test_the_model_s_score_is_a_trusted_auditor_s_for_this_content_and_task():
    from swarm.dht.validation import ed25519_text
    from swarm.reports.records import AdapterAudit, AuditBook, AuditReport

    auditor, stranger, author = (ed25519_text(Ed25519PrivateKey.generate()) for _ in range(3))
    sha, other = "a" * 64, "b" * 64
    now = time.time()

    def report(signer: str, entries: tuple) -> AuditReport:
        return AuditReport("p", 1, now, (), signer, entries)

    book = AuditBook("p", frozenset({auditor}))
    assert book.consider(report(auditor, (AdapterAudit("hb", author, sha, "host-blocks", 60, 45, now),
                                          AdapterAudit("hb", author, other, "addition", 60, 60, now))))
    assert not book.consider(report(stranger, (AdapterAudit("hb", author, other, "host-blocks", 60, 60, now),)))
    assert audited(book, sha).correct == 45 and audited(book, sha).examples == 60
    assert audited(book, other) is None, "another task's score, or a stranger's, is no score"
    assert audited(None, sha) is None


def test_a_local_adapter_folder_answers_offline_with_no_audited_score(tiny_model_path, local_lm, tmp_path):
    from swarm.eval.tasks import task_answer
    from swarm.testing.adapters import random_soft_prompt

    folder = str(random_soft_prompt(local_lm, tmp_path / "soft", 1.0, 2))
    result = advise("--coverage", "21030112", "--blocks", "3", "--adapter", folder, "--model", str(tiny_model_path),
                    "--json")
    assert result.exit_code == 0, result.output
    advice = json.loads(result.stdout)
    answer = task_answer(local_lm, "21030112|3=", SETTINGS, {"adapter": folder})
    assert advice["model"]["answer"] == answer and advice["model"]["who"] == folder
    assert advice["model"]["right"] == HostBlocksTask().check("21030112|3=", answer)
    assert advice["model"]["score"] is None and advice["recommended"] == "rule"
    assert "no auditor you trust" in advice["why"]


def test_the_rule_s_score_is_reproducible_and_the_names_agree():
    from swarm.advise.config import DEFAULT_ADAPTER, TASK
    from swarm.reports.records import BEST

    assert rule_score(200, 3) == rule_score(200, 3)
    assert TASK == HostBlocksTask.name and DEFAULT_ADAPTER == f"{BEST}{HostBlocksTask.name}"


def test_the_live_map_is_the_question(local_swarm, tiny_model_path, local_lm, tmp_path):
    """On the shared swarm (servers 0:2, 2:4, 1:4 of 4 blocks): the map's coverage is asked; a 4-block model is no
    host-blocks question; best:host-blocks with no trusted auditor says so in one line and the rule stands alone; an
    adapter folder answers through the swarm as it does here."""
    peers = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
    result = advise(*peers, "--model", str(tiny_model_path), "--blocks", "2", "--json")
    assert result.exit_code == 0, result.output
    advice = json.loads(result.stdout)
    assert advice["question"]["coverage"] == [1, 2, 2, 2] and advice["rule"]["start"] == 0
    assert "models of 8 blocks" in advice["missing"]
    given = advise(*peers, "--model", str(tiny_model_path), "--coverage", "21030112", "--blocks", "3",
                   "--trusted-auditors", "none", "--json")
    assert given.exit_code == 0, given.output
    advice = json.loads(given.stdout)
    assert advice["model"] is None and "trusts no auditor" in advice["missing"] and advice["recommended"] == "rule"
    from swarm.eval.tasks import task_answer
    from swarm.testing.adapters import random_soft_prompt

    folder = str(random_soft_prompt(local_lm, tmp_path / "soft", 1.0, 2))
    through = advise(*peers, "--model", str(tiny_model_path), "--coverage", "21030112", "--blocks", "3",
                     "--adapter", folder, "--trusted-auditors", "none", "--json")
    assert through.exit_code == 0, through.output
    model = json.loads(through.stdout)["model"]
    assert model["answer"] == task_answer(local_lm, "21030112|3=", SETTINGS, {"adapter": folder})
    assert model["score"] is None, "no trusted auditor: not audited"
