"""What a new user meets on the first day (issue 37): threads, defaults that say what they are, Hugging Face habits,
progress that fits the terminal. Items 2 and 4 (fast answers, no peers) are tested in test_cli.py and
test_config_settings.py.
"""
from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from swarm.cli.options import EXIT_USAGE
from swarm.frontend.lm import RANDOM_SEEDS
from swarm.frontend.local import DiffusionLM
from swarm.generate import main as generate_cli
from swarm.server.__main__ import main as server_cli
from swarm.utils.progress import StepLine, fit
from swarm.utils.threads import default_threads

ROOT = Path(__file__).resolve().parents[1]
SHORT = dict(gen_length=8, steps=8, block_length=8)


# ----- item 1: threads ---------------------------------------------------------------------------------------
THREADS_PROBE = """
import sys, torch
import swarm
from swarm.utils.threads import apply_threads
torch.set_num_threads(7)  # torch's default takes every core; 7 stands for "not chosen by swarm"
swarm.DiffusionLM.from_pretrained(sys.argv[1])
chosen = torch.get_num_threads()
swarm.DiffusionLM.from_pretrained(sys.argv[1], threads=2)
given = torch.get_num_threads()
torch.set_num_threads(3)
swarm.DiffusionLM.from_pretrained(sys.argv[1])  # the count chosen before (or set since) stays
kept = torch.get_num_threads()
print(chosen, given, kept)
"""


@pytest.mark.swarm  # a fresh Python process
def test_the_python_api_chooses_threads_as_the_commands_do(tiny_model_path, monkeypatch):
    """The quick start took 48.0 s for 64 tokens with torch's 2 threads, 5.6 s with 1 (issue 37)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    done = subprocess.run([sys.executable, "-c", THREADS_PROBE, str(tiny_model_path)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    chosen, given, kept = map(int, done.stdout.split())
    assert (chosen, given, kept) == (default_threads(), 2, 3)


# ----- item 3: defaults that say what they are ---------------------------------------------------------------
def test_help_says_the_model_decides_where_its_generation_json_does():
    """``--temperature [default: 0.0]`` and ``--remasking [default: low_confidence]`` were not what ran."""
    text = " ".join(CliRunner().invoke(generate_cli, ["--help"], terminal_width=200).output.split())
    for flag, fallback in (("--temperature", "0.0"), ("--remasking", "low_confidence"), ("--threshold", "None"),
                           ("--cfg-scale", "0.0")):
        entry = text[text.index(flag):][:400]
        entry = entry[:entry.index(" --", 3)]
        assert f"Default: model default (its generation.json), else {fallback}." in entry, entry
        assert "[default:" not in entry, entry


def test_the_values_used_are_in_info_and_the_seed_is_random_unless_given():
    lm = DiffusionLM.from_pretrained("default")  # its generation.json: entropy, temperature 0.5
    first, second = (lm.generate("Once upon a time", **SHORT) for _ in range(2))
    used = first.info["settings"]
    assert (used["temperature"], used["remasking"], used["gen_length"]) == (0.5, "entropy", 8)
    assert 0 <= used["seed"] < RANDOM_SEEDS and used["seed"] != second.info["settings"]["seed"]
    again = lm.generate("Once upon a time", **SHORT, seed=used["seed"])
    assert again.token_ids == first.token_ids and again.info["settings"]["seed"] == used["seed"]
    greedy = lm.generate("Once upon a time", **SHORT, temperature=0.0)
    assert greedy.info["settings"]["seed"] == 0


def test_the_command_prints_the_values_used_and_a_given_seed_repeats(tiny_model_path):
    base = ["Hi", "--model", str(tiny_model_path), "--gen-length", "8", "--threads", "1", "--temperature", "0.7"]
    runs = [CliRunner().invoke(generate_cli, base + ["--seed", "11"]) for _ in range(2)]
    assert runs[0].exit_code == 0 and runs[0].stdout == runs[1].stdout, runs[0].output
    assert "temperature 0.7, remasking low_confidence, seed 11; ran: local)" in runs[0].stderr


# ----- item 5: what Hugging Face and Petals users type -------------------------------------------------------
def test_max_new_tokens_is_gen_length_and_other_libraries_names_get_the_name_to_use(tiny_model_path):
    lm = DiffusionLM.from_pretrained(tiny_model_path)
    taken = lm.generate("hi", max_new_tokens=8, seed=3)
    assert taken.token_ids == lm.generate("hi", gen_length=8, seed=3).token_ids and len(taken.token_ids) == 8
    assert taken.info["settings"]["gen_length"] == 8
    with pytest.raises(ValueError, match=r"max_new_tokens=8 and gen_length=16 disagree"):
        lm.generate("hi", max_new_tokens=8, gen_length=16)
    with pytest.raises(TypeError, match=r"max_tokens: use gen_length=8 instead of max_tokens"):
        lm.generate("hi", max_tokens=8)


def test_the_server_takes_the_model_as_a_positional_argument():
    """``python -m swarm.server default`` (as ``petals.cli.run_server MODEL``) said "unexpected extra argument"."""
    result = CliRunner().invoke(server_cli, ["/nonexistent/model", "--throughput", "1"])
    assert result.exit_code == EXIT_USAGE and "/nonexistent/model" in result.stderr
    assert "neither a checkpoint directory" in result.stderr, result.stderr
    both = CliRunner().invoke(server_cli, ["one", "--model", "two"])
    assert both.exit_code == EXIT_USAGE and "two models given" in both.stderr


# ----- item 6: progress --------------------------------------------------------------------------------------
class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_one_line_that_fits_it(monkeypatch):
    """It redrew lines of up to 200 characters with ``\\r``: on 100 columns each step left a new line."""
    monkeypatch.setenv("COLUMNS", "40")
    terminal = Terminal()
    line = StepLine(stream=terminal)
    for step in range(3):
        line.show(f"[step {step}] " + "word " * 50)
    line.close()
    redraws = terminal.getvalue().split("\r")[1:]
    assert len(redraws) == 3 and terminal.getvalue().count("\n") == 1
    assert all(len(redraw.rstrip("\n")) == 39 for redraw in redraws), [len(r) for r in redraws]
    assert redraws[0].startswith("[step 0] word") and "..." in redraws[0]


def test_progress_elsewhere_is_plain_lines(tiny_model_path):
    log = io.StringIO()
    line = StepLine(stream=log)
    line.show("[step 1] a\nb")
    line.show("[step 2] " + "x" * 300)
    line.close()
    assert log.getvalue().splitlines() == ["[step 1] a b", "[step 2] " + "x" * 188 + "..."]
    assert "\r" not in log.getvalue()
    assert fit("abc", 2) == "ab" and fit("a  b", 10) == "a b"


def test_progress_in_a_log_is_one_line_per_n_steps_and_the_last():
    """A captured quick start held 64 ``[step N]`` fragments on one line (``\\r`` redraws in a log)."""
    log = io.StringIO()
    line = StepLine(stream=log, plain_every=4)
    for step in range(1, 11):
        line.show(f"[step {step}]")
    line.close()
    assert log.getvalue().splitlines() == ["[step 1]", "[step 5]", "[step 9]", "[step 10]"]
    quiet = io.StringIO()
    StepLine(enabled=False, stream=quiet).show("[step 1]")
    assert quiet.getvalue() == ""


def test_generate_shows_progress_lines_off_a_terminal_and_none_when_quiet(tiny_model_path):
    command = ["Hi", "--model", str(tiny_model_path), "--gen-length", "8", "--block-length", "8", "--threads", "1"]
    result = CliRunner().invoke(generate_cli, command + ["--steps", "4"])
    steps = [text for text in result.stderr.splitlines() if text.startswith("[step ")]
    assert [text.split("]")[0] for text in steps] == ["[step 1", "[step 4"], result.stderr  # one per 16, the last
    assert "\r" not in result.stderr and "ran: local)" in result.stderr
    quiet = CliRunner().invoke(generate_cli, command + ["--steps", "4", "--quiet"])
    assert quiet.exit_code == 0 and quiet.stderr == "" and quiet.stdout == result.stdout, quiet.output
