"""The subword (BPE) tokenizer of the project's own models: learnt, saved with the model, loaded the same way
as the byte tokenizer; the model's sampling defaults; the readability figures of ``swarm.eval.text_quality``."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from swarm.eval.likelihood import evaluate_likelihood
from swarm.eval.text_quality import (
    TextQuality,
    balanced_brackets,
    is_code_shaped,
    load_dictionary,
    parse_experts,
    repeated_trigrams,
)
from swarm.frontend.local import DiffusionLM
from swarm.models.loading import GENERATION_DEFAULTS_FILE, ModelFiles
from swarm.models.modules import DiffusionTransformer
from swarm.models.tokenizer import ByteTokenizer, SubwordTokenizer
from swarm.train.data import AdditionTask, TextCorpus, encode_problems
from swarm.train.export import export_model
from swarm.train.loop import STATE_FILE, train
from swarm.train.tokenizer import train_subword_tokenizer
from tests.test_train import one_thread, toy_config  # noqa: F401  (autouse fixture: one torch thread)

TEXTS = ["The quick brown fox jumps over the lazy dog. It was 1024 feet away. " * 40,
         "def jump(fox, dog):\n    return fox + dog  # 3 + 4\n" * 40]


@pytest.fixture(scope="module")
def subword() -> SubwordTokenizer:
    return train_subword_tokenizer(TEXTS, vocab_size=320)


@pytest.fixture(scope="module")
def subword_model(tmp_path_factory, subword) -> Path:
    """A tiny model trained a few steps with the subword tokenizer, exported as a shippable directory."""
    root = tmp_path_factory.mktemp("subword")
    subword.save(root)
    run = train(toy_config(root / "run", steps=4, tokenizer=str(root / SubwordTokenizer.FILE)),
                TextCorpus(TEXTS, "toy", subword))
    return export_model(run, root / "model")


def test_specials_come_first_and_digits_are_single_tokens(subword):
    assert (subword.pad_token_id, subword.bos_token_id, subword.eos_token_id, subword.mask_token_id) == (0, 1, 2, 3)
    assert 260 < subword.vocab_size <= 320  # fewer when the text offers too few merges
    ids = subword.encode("1024+37=1061")
    assert [subword.decode([i]) for i in ids] == list("1024+37=1061")
    assert len(subword.encode(" the quick brown fox")) < len(" the quick brown fox")  # merges were learnt


@pytest.mark.parametrize("text", ["The quick brown fox.", "def f(x):\n        return x", "naïve café – 12", "\n\n  "])
def test_round_trip_of_any_text(subword, text):
    assert subword.decode(subword.encode(text)) == text


def test_decode_drops_specials_and_shows_masks(subword):
    ids = subword.encode("the lazy dog")
    with_specials = [subword.bos_token_id, *ids, subword.eos_token_id, subword.pad_token_id]
    assert subword.decode(with_specials) == "the lazy dog"
    masked = [*ids[:1], subword.mask_token_id, *ids[2:]]
    assert subword.decode(masked, mask_placeholder="_").count("_") == 1
    assert "_" not in subword.decode(masked)
    with pytest.raises(ValueError, match="chat template"):
        subword.encode_chat("hi")


def test_fingerprint_tells_vocabularies_apart(subword, tmp_path):
    other = train_subword_tokenizer(TEXTS, vocab_size=300)
    assert subword.fingerprint() != other.fingerprint() != ByteTokenizer().fingerprint()
    reloaded = SubwordTokenizer.from_file(subword.save(tmp_path))
    assert reloaded.fingerprint() == subword.fingerprint()


def test_a_tokenizer_without_the_special_tokens_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    bare = Tokenizer(models.BPE())
    with pytest.raises(ValueError, match="special tokens"):
        SubwordTokenizer(bare)


def test_trained_model_ships_and_loads_its_tokenizer(subword_model, subword):
    assert (subword_model / SubwordTokenizer.FILE).exists()
    files = ModelFiles(subword_model)
    assert files.config.tokenizer == "bpe" and files.config.vocab_size == subword.vocab_size
    assert files.config.mask_token_id == subword.mask_token_id
    assert files.tokenizer().fingerprint() == subword.fingerprint()
    info = json.loads((subword_model / "training.json").read_text())
    assert info["train_config"]["tokenizer"] == SubwordTokenizer.FILE
    lm = DiffusionLM.from_pretrained(subword_model)
    result = lm.generate("the quick", gen_length=8, steps=8)
    assert len(result.token_ids) == 8 and all(0 <= t < subword.vocab_size for t in result.token_ids)
    assert subword.mask_token_id not in result.token_ids


def test_resumed_subword_run_keeps_its_own_tokenizer_copy(tmp_path, subword):
    subword.save(tmp_path)
    corpus = TextCorpus(TEXTS, "toy", subword)
    cfg = toy_config(tmp_path / "run", steps=4, tokenizer=str(tmp_path / SubwordTokenizer.FILE))
    train(cfg, corpus, stop_at=2)
    (tmp_path / SubwordTokenizer.FILE).unlink()  # the run's copy is what a resume reads
    train(cfg, corpus)
    assert torch.load(tmp_path / "run" / STATE_FILE, weights_only=False)["step"] == 4


def test_each_source_keeps_its_own_held_out_tail(subword):
    corpus = TextCorpus(TEXTS, "toy", subword)
    held_out_text = subword.decode(corpus.held_out_ids.tolist())
    assert "dog" in held_out_text and "return" in held_out_text  # both sources' tails


def test_addition_rows_in_subword_ids(subword):
    task = AdditionTask(tokenizer=subword)
    problems = task.problems(4, seed=0, held_out=False)
    rows = encode_problems(problems, 16, subword)
    for row, problem in zip(rows.tolist(), problems):
        assert row[0] == subword.bos_token_id
        assert subword.decode(row) == problem.prompt + problem.answer
    given = task.given_positions(rows)
    for row, keep, problem in zip(rows.tolist(), given.tolist(), problems):
        prompt_tokens = 1 + len(subword.encode(problem.prompt))
        assert keep[:prompt_tokens] == [True] * prompt_tokens and not any(keep[prompt_tokens:])


def test_bits_per_byte_counts_the_text_of_subword_rows(subword):
    """A uniform model costs log(V) per token; per byte that is log(V) * tokens / bytes of the decoded text."""
    from swarm.models.config import ModelConfig

    config = ModelConfig(vocab_size=subword.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=2, mask_token_id=3, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, tokenizer="bpe")
    model = DiffusionTransformer(config)
    torch.nn.init.zeros_(model.head.lm_head.weight)
    corpus = TextCorpus(TEXTS, "toy", subword)
    report = evaluate_likelihood(model, corpus, examples=32, seq_len=24, t_draws=8, seed=0)
    rows = corpus.batch(32, 24, torch.Generator().manual_seed(0), held_out=True)
    bytes_per_token = sum(len(subword.decode(r[1:].tolist()).encode()) for r in rows) / (32 * 23)
    assert bytes_per_token > 1.5
    assert report.nats_per_token == pytest.approx(math.log(subword.vocab_size), rel=0.1)
    expected = report.nats_per_token / bytes_per_token / math.log(2)
    assert report.bits_per_byte == pytest.approx(expected, rel=0.1)


# ----- the model's own sampling defaults ---------------------------------------------------------------
def with_defaults(model_dir: Path, tmp_path: Path, defaults) -> Path:
    import shutil

    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    (target / GENERATION_DEFAULTS_FILE).write_text(json.dumps(defaults))
    return target


def test_sampling_defaults_apply_and_the_callers_settings_win(subword_model, tmp_path):
    plain = DiffusionLM.from_pretrained(subword_model)
    tuned = DiffusionLM.from_pretrained(with_defaults(subword_model, tmp_path, {"remasking": "random",
                                                                               "temperature": 0.7}))
    assert dict(tuned.sampling_defaults) == {"remasking": "random", "temperature": 0.7}
    settings = dict(gen_length=16, steps=16, seed=3)
    defaulted = tuned.generate("the quick", **settings).token_ids
    assert defaulted == plain.generate("the quick", remasking="random", temperature=0.7, **settings).token_ids
    overridden = tuned.generate("the quick", remasking="low_confidence", temperature=0.0, **settings).token_ids
    assert overridden == plain.generate("the quick", **settings).token_ids


@pytest.mark.parametrize("defaults, message", [
    ({"gen_length": 8}, "may only set"),
    ({"temperature": -1}, "temperature"),
    ({"remasking": "sideways"}, "remasking"),
    (["temperature"], "may only set"),
])
def test_bad_sampling_defaults_are_refused(subword_model, tmp_path, defaults, message):
    with pytest.raises(ValueError, match=message):
        DiffusionLM.from_pretrained(with_defaults(subword_model, tmp_path, defaults))


# ----- readability figures -------------------------------------------------------------------------------
def test_repeated_trigrams_count_each_repeat():
    assert repeated_trigrams("the cat sat on the mat") == (0, 4)
    assert repeated_trigrams("in the mand in the mand in the mand") == (4, 7)
    assert repeated_trigrams("one two") == (0, 0)


def test_dictionary_share_and_code_shape(tmp_path):
    words = tmp_path / "words"
    words.write_text("the\ncat\ncat's\nsat\n")
    dictionary = load_dictionary(words)
    quality = TextQuality({})
    quality.add("p", "The cat sat on the mand.", dictionary)
    assert (quality.dictionary_words, quality.words) == (4, 6)
    assert balanced_brackets("f(a[1], {2: (3)})") and not balanced_brackets("f(a]") and not balanced_brackets("((")
    assert is_code_shaped("\n    return f(x)\n") and not is_code_shaped(" " * 63) and not is_code_shaped("the cat")
    assert not is_code_shaped("return f(x")
    assert not is_code_shaped("It is in the house, for him and her (as it was).")  # English, however many "in"s
    assert parse_experts("code=1,addition=0.5") == {"code": 1.0, "addition": 0.5} and parse_experts("auto") == "auto"
    with pytest.raises(FileNotFoundError, match="wamerican"):
        load_dictionary(tmp_path / "missing")


def test_the_playground_form_starts_from_the_models_defaults():
    from swarm.web.routes import playground_settings

    declared = {item["name"]: item["default"] for item in playground_settings()}
    tuned = {item["name"]: item["default"] for item in playground_settings({"temperature": 0.5})}
    assert declared["temperature"] == 0.0 and tuned["temperature"] == 0.5
    assert {k: v for k, v in tuned.items() if k != "temperature"} == {
        k: v for k, v in declared.items() if k != "temperature"}


def test_the_playground_page_has_an_input_for_every_setting_it_offers():
    """The form's inputs are written in playground.html and configured from PLAYGROUND_SETTINGS: a setting named
    there without its input leaves the page never ready; draft-and-verify and the adaptive refresh are offered."""
    import re

    from swarm.web.routes import PLAYGROUND_SETTINGS, STATIC, playground_settings

    page = (STATIC / "playground.html").read_text()
    inputs = set(re.findall(r'<(?:input|select) id="([a-z_]+)"', page)) - {"prompt"}
    assert inputs == set(PLAYGROUND_SETTINGS)
    offered = {item["name"]: item for item in playground_settings()}
    assert offered["draft_steps"]["low"] == 0 and offered["cache_refresh_drift"]["high"] == 1.0
    assert offered["cache_refresh_drift"]["default"] is None  # empty field: the API's default (no adaptive refresh)
