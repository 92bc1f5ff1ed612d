"""The tiers of docs/TESTING.md agree with tests/conftest.py (issue 56): every tier is documented with the command
that runs it and registered as a marker, and the unit tier's budget in the docs is the one each run reports
against (tests/tier_costs.py)."""
from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest

from tests.conftest import IN_PROCESS_TIERS, TIERS, _guarded
from tests.tier_costs import BUDGETS, TierCosts

ROOT = Path(__file__).resolve().parents[1]
TESTING = (ROOT / "docs" / "TESTING.md").read_text()


def tier_table() -> dict[str, str]:
    """The rows of TESTING.md's tier table: tier name -> the command in its last column."""
    section = TESTING.split("## Tiers", 1)[1].split("\n## ", 1)[0]
    return {match[1]: match[2] for match in re.finditer(r"^\| `(\w+)` \|.*\| `([^`]+)` \|$", section, re.M)}


def test_every_tier_is_documented_with_its_command_and_registered():
    table = tier_table()
    assert list(table) == list(TIERS), "TESTING.md's tier table lists the tiers of tests/conftest.py, in order"
    for tier, command in table.items():
        assert command == f"python -m pytest -q -m {tier}"
    markers = (ROOT / "pyproject.toml").read_text().split("markers = [", 1)[1].split("]", 1)[0]  # 3.10: no tomllib
    assert set(re.findall(r'^\s+"(\w+): ', markers, re.M)) >= set(TIERS)
    assert set(IN_PROCESS_TIERS) <= set(TIERS)


@pytest.mark.parametrize("tier", TIERS)
def test_unit_and_wide_tests_run_guarded_and_the_others_not(tier):
    """A wide test is held to the unit tier's rule (no process, no network socket), as the tier table says."""

    class Item:
        def get_closest_marker(self, name):
            return name if name == tier else None

    guarded = not isinstance(_guarded(Item()), contextlib.nullcontext)
    assert guarded == (tier in ("unit", "wide"))


@pytest.mark.parametrize("tier", sorted(BUDGETS))
def test_the_documented_budget_is_the_one_runs_report_against(tier):
    seconds, gigabytes = BUDGETS[tier]
    budget = re.search(rf"`-m {tier}` budget: under (\d+) s and (\d+) GB", TESTING)
    assert budget, f"TESTING.md states the {tier} tier's budget"
    assert (float(budget[1]), float(budget[2])) == (seconds, gigabytes)


def test_the_summary_counts_each_tier_once_and_names_the_budget(capsys, monkeypatch):
    """The line CI prints: tests per tier (a failed setup counts, its teardown adds no test), and the budget line
    only when one budgeted tier ran alone."""

    class Report:
        def __init__(self, nodeid, when, tier, passed=True, measured=None):
            self.nodeid, self.when, self.keywords, self.passed, self.duration = nodeid, when, {tier: 1}, passed, 0.5
            self.user_properties = [("tier_costs", measured)] if measured else []

    class Terminal:
        def section(self, title):
            print(f"== {title}")

        def write_line(self, line):
            print(line)

    monkeypatch.delenv("TEST_COSTS", raising=False)  # these made-up tests go into no record of the run
    costs = TierCosts(TIERS, worker=False)
    for phase in ("setup", "call"):
        costs.pytest_runtest_logreport(Report("a", phase, "unit"))
    costs.pytest_runtest_logreport(Report("a", "teardown", "unit", measured=(1.5, 300.0)))
    costs.pytest_runtest_logreport(Report("b", "setup", "unit", passed=False))
    costs.pytest_runtest_logreport(Report("b", "teardown", "unit", measured=(0.5, 900.0)))
    costs.pytest_terminal_summary(Terminal())
    out = capsys.readouterr().out
    assert "unit: 2 tests, 2.5 s of test time, 2.0 CPU s, peak 0.88 GB" in out
    assert "unit budget: 60 s and 2 GB" in out
    costs.pytest_runtest_logreport(Report("c", "call", "swarm"))
    costs.pytest_terminal_summary(Terminal())
    assert "budget" not in capsys.readouterr().out.split("session:")[1]
