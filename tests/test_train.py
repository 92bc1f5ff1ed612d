"""The training command: LLaDA's objective, a loss that falls, and resumption that changes nothing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from swarm.models.loading import ModelFiles
from swarm.models.tokenizer import ByteTokenizer
from swarm.train.__main__ import main as train_cli
from swarm.train.data import AdditionTask, TextCorpus, encode_problems
from swarm.train.loop import STATE_FILE, TRAINING_INFO_FILE, TrainConfig, train
from swarm.train.objective import diffusion_loss, mask_tokens

TOY_TEXT = ("the quick brown fox jumps over the lazy dog. " * 200).encode()


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as the training command uses here: on a busy 2-core machine more threads thrash.

    Restored afterwards, since ``train(threads=1)`` sets the process-wide count.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def toy_config(output: Path, **changes) -> TrainConfig:
    settings = dict(output=str(output), corpus="files", steps=12, batch_size=8, seq_len=32, lr=3e-3, warmup=2,
                    hidden_size=32, layers=2, heads=4, kv_heads=2, intermediate_size=64, save_every=4, threads=1)
    settings.update(changes)
    return TrainConfig(**settings)


def test_masking_rate_follows_t():
    tokens = torch.randint(0, 256, (3, 4001))
    t = torch.tensor([0.1, 0.5, 0.9])
    noisy, masked, t_out = mask_tokens(tokens, ByteTokenizer.MASK, torch.Generator().manual_seed(0), t=t)
    assert torch.equal(t_out, t)
    assert not masked[:, 0].any(), "BOS is never masked"
    rates = masked[:, 1:].float().mean(1)
    assert torch.allclose(rates, t, atol=0.03)
    assert torch.equal(noisy == ByteTokenizer.MASK, masked)
    assert torch.equal(noisy[~masked], tokens[~masked])


def test_given_positions_are_never_masked():
    tokens = torch.randint(0, 256, (4, 64))
    given = torch.zeros_like(tokens, dtype=torch.bool)
    given[:, :10] = True
    _, masked, _ = mask_tokens(tokens, ByteTokenizer.MASK, torch.Generator().manual_seed(0), t=torch.ones(4),
                               given=given)
    assert torch.equal(masked, ~given)


def test_drawn_t_is_uniform_and_sets_each_row_rate():
    tokens = torch.randint(0, 256, (512, 257))
    _, masked, t = mask_tokens(tokens, ByteTokenizer.MASK, torch.Generator().manual_seed(1))
    assert 0 < t.min() and t.max() <= 1 and abs(t.mean().item() - 0.5) < 0.05
    assert (masked[:, 1:].float().mean(1) - t).abs().max() < 0.15


def test_loss_weights_masked_tokens_by_inverse_t():
    tokens = torch.tensor([[ByteTokenizer.BOS, 5, 6, 7]])
    logits = torch.zeros(1, 4, ByteTokenizer.vocab_size)  # uniform: every masked token costs log(vocab)
    masked = torch.tensor([[False, True, False, True]])
    loss = diffusion_loss(logits, tokens, masked, torch.tensor([0.5]))
    expected = 2 * torch.log(torch.tensor(float(ByteTokenizer.vocab_size))) / 0.5 / 4
    assert torch.isclose(loss, expected)


def fixed_batch_loss(path: Path, corpus: TextCorpus) -> float:
    model = ModelFiles(path).full_model()
    generator = torch.Generator().manual_seed(123)
    tokens = corpus.batch(32, 32, generator)
    t = torch.linspace(0.05, 1.0, 32)
    noisy, masked, t = mask_tokens(tokens, model.config.mask_token_id, generator, t=t)
    with torch.no_grad():
        return diffusion_loss(model(noisy), tokens, masked, t).item()


def test_loss_falls_on_a_tiny_run(tmp_path):
    corpus = TextCorpus(TOY_TEXT, "toy")
    before = fixed_batch_loss(train(toy_config(tmp_path / "a", steps=60), corpus, stop_at=1), corpus)
    after = fixed_batch_loss(train(toy_config(tmp_path / "a", steps=60), corpus), corpus)
    assert after < 0.7 * before, (before, after)
    info = json.loads((tmp_path / "a" / TRAINING_INFO_FILE).read_text())
    assert info["step"] == 60 and info["train_config"]["hidden_size"] == 32 and info["wall_s"] > 0


@pytest.mark.parametrize("corpus", [TextCorpus(TOY_TEXT, "toy"), AdditionTask()], ids=["text", "addition"])
def test_resumed_run_matches_uninterrupted_run(tmp_path, corpus):
    straight = train(toy_config(tmp_path / "straight"), corpus)
    train(toy_config(tmp_path / "split"), corpus, stop_at=6)  # saves at 4 and at 6, off the save period
    assert torch.load(tmp_path / "split" / STATE_FILE, weights_only=False)["step"] == 6
    split = train(toy_config(tmp_path / "split"), corpus)
    a = torch.load(straight / STATE_FILE, weights_only=False)
    b = torch.load(split / STATE_FILE, weights_only=False)
    assert a["step"] == b["step"] == 12
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert (straight / "model.safetensors").read_bytes() == (split / "model.safetensors").read_bytes()
    assert not (split / ".saving").exists()


def test_addition_rows_are_bos_problem_eos_padding():
    problems = AdditionTask().problems(4, seed=0, held_out=False)
    rows = encode_problems(problems, 16)
    for problem, row in zip(problems, rows.tolist()):
        text = (problem.prompt + problem.answer).encode()
        assert row[0] == ByteTokenizer.BOS and bytes(row[1: 1 + len(text)]) == text
        assert set(row[1 + len(text):]) == {ByteTokenizer.EOS}
        assert int(problem.prompt.split("+")[0]) + int(problem.prompt[:-1].split("+")[1]) == int(problem.answer)
    given = AdditionTask().given_positions(rows)
    for problem, row_given in zip(problems, given.tolist()):
        assert row_given == [True] * (1 + len(problem.prompt)) + [False] * (16 - 1 - len(problem.prompt))
    held_out = AdditionTask().problems(50, seed=0, held_out=True)
    assert all(AdditionTask.is_held_out(p) for p in held_out)
    assert not any(AdditionTask.is_held_out(p) for p in AdditionTask().problems(200, seed=0, held_out=False))


def test_addition_rows_end_at_random_lengths_keeping_answer_and_one_eos():
    rows = AdditionTask().batch(256, 24, torch.Generator().manual_seed(0))
    lengths = (rows != ByteTokenizer.PAD).sum(1)
    assert len(set(lengths.tolist())) > 5 and int(lengths.max()) <= 24
    for row, length in zip(rows.tolist(), lengths.tolist()):
        assert row[length:] == [ByteTokenizer.PAD] * (24 - length)
        assert row[length - 1] == ByteTokenizer.EOS and ByteTokenizer.PAD not in row[:length]
    given = AdditionTask().given_positions(rows)
    assert torch.equal(given & (rows == ByteTokenizer.PAD), rows == ByteTokenizer.PAD)
    _, masked, _ = mask_tokens(rows, ByteTokenizer.MASK, torch.Generator().manual_seed(0), t=torch.ones(256),
                               given=given)
    assert not (masked & (rows == ByteTokenizer.PAD)).any()


def test_cli_trains_on_files_and_resumes(tmp_path):
    data = tmp_path / "data.txt"
    data.write_bytes(TOY_TEXT)
    args = ["--output", str(tmp_path / "run"), "--data", str(data), "--steps", "3", "--batch-size", "4",
            "--seq-len", "16", "--hidden-size", "32", "--layers", "1", "--heads", "4", "--kv-heads", "2",
            "--intermediate-size", "64", "--save-every", "2", "--threads", "1"]
    state = tmp_path / "run" / STATE_FILE
    result = CliRunner().invoke(train_cli, args + ["--stop-at", "2"])  # step 2 of a 3-step schedule
    assert result.exit_code == 0, result.output
    assert torch.load(state, weights_only=False)["step"] == 2
    result = CliRunner().invoke(train_cli, args)
    assert result.exit_code == 0, result.output
    assert "checkpoint written" in result.output
    assert torch.load(state, weights_only=False)["step"] == 3
    assert ModelFiles(tmp_path / "run").config.num_layers == 1
    result = CliRunner().invoke(train_cli, args[:5] + ["4"] + args[6:])  # --steps 4: one more step
    assert result.exit_code == 0, result.output
    assert torch.load(state, weights_only=False)["step"] == 4
