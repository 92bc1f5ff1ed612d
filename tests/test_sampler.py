"""The sampler's contract: schedule, prompt untouched, determinism, argmax, CFG, strategy orders, Picard."""
from __future__ import annotations

import pytest
import torch

from swarm.diffusion.config import GenerationConfig
from swarm.diffusion.prediction import predict_block
from swarm.diffusion.remasking import STRATEGIES
from swarm.diffusion.sampler import DiffusionSampler, num_transfer_schedule

MASK, EOS, VOCAB = 9, 8, 10


class RandomDenoiser:
    """Logits that depend on the whole input (like a model does), deterministic per input."""

    def __init__(self, seed: int = 0):
        self.calls: list[torch.Tensor] = []
        torch.manual_seed(seed)
        self.table = torch.randn(VOCAB, 3, VOCAB)

    def __call__(self, tokens, context):
        self.calls.append(tokens.clone())
        summary = tokens.sum(-1, keepdim=True) % 3
        positions = torch.arange(tokens.shape[1])[None] % 3
        return self.table[tokens, (positions + summary) % 3] * 3


def run(config: GenerationConfig, prompt=(1, 2, 3), denoiser=None, eos=()):
    sampler = DiffusionSampler(denoiser or RandomDenoiser(), config, MASK, eos)
    return sampler, list(sampler.iterate(list(prompt)))


def test_schedule_spreads_evenly_with_extras_first():
    assert num_transfer_schedule(10, 4) == [3, 3, 2, 2]
    assert sum(num_transfer_schedule(32, 7)) == 32


@pytest.mark.parametrize("remasking", list(STRATEGIES))
def test_unmasks_scheduled_count_per_step_inside_current_block_and_never_touches_prompt(remasking):
    config = GenerationConfig(gen_length=12, steps=6, block_length=4, remasking=remasking, temperature=0.7)
    sampler, events = run(config)
    schedule = num_transfer_schedule(4, 2)
    assert len(events) == 6
    previous = sampler.initial_state([1, 2, 3])
    for i, event in enumerate(events):
        assert len(event.unmasked) == schedule[i % 2]
        start = 3 + (i // 2) * 4
        assert all(start <= p < start + 4 for p in event.unmasked)
        changed = (event.tokens != previous).nonzero().flatten().tolist()
        assert changed == event.unmasked
        assert event.tokens[:3].tolist() == [1, 2, 3]
        assert MASK not in event.tokens[event.unmasked].tolist()
        previous = event.tokens
    assert MASK not in events[-1].tokens.tolist()


def test_deterministic_for_seed_and_seed_matters():
    config = GenerationConfig(gen_length=16, steps=16, block_length=8, temperature=1.0)
    a = run(config)[1][-1].tokens
    b = run(config)[1][-1].tokens
    c = run(config.replace(seed=5))[1][-1].tokens
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_temperature_zero_takes_argmax():
    denoiser = RandomDenoiser()
    config = GenerationConfig(gen_length=8, steps=8, block_length=8)
    sampler, events = run(config, denoiser=denoiser)
    for call, event in zip(denoiser.calls, events):
        logits = RandomDenoiser()(call, None)[0]
        logits[:, MASK] = float("-inf")
        for p in event.unmasked:
            assert event.tokens[p] == logits[p].argmax()


def test_low_confidence_picks_the_most_confident_position():
    denoiser = RandomDenoiser()
    config = GenerationConfig(gen_length=8, steps=8, block_length=8)
    _, events = run(config, denoiser=denoiser)
    first_logits = denoiser.calls[0]
    logits = RandomDenoiser()(first_logits, None)[0, 3:11].double()
    logits[:, MASK] = float("-inf")
    confidence = torch.softmax(logits, -1).max(-1).values
    assert events[0].unmasked == [3 + int(confidence.argmax())]


def test_cfg_combines_conditional_and_unconditional_logits():
    seen = {}

    def denoiser(tokens, context):
        seen["tokens"] = tokens.clone()
        out = torch.zeros(tokens.shape[0], tokens.shape[1], VOCAB)
        out[0, :, 0] = 2.0  # conditional row
        out[1, :, 0] = 0.5  # unconditional row
        return out

    config = GenerationConfig(gen_length=4, steps=4, block_length=4, cfg_scale=1.5)
    sampler = DiffusionSampler(denoiser, config, MASK)
    sampler.initial_state([1, 2])
    logits = sampler.evaluate(sampler.initial_state([1, 2])[None], [0])
    assert seen["tokens"].shape[0] == 2
    assert seen["tokens"][1, :2].tolist() == [MASK, MASK], "the unconditional pass masks the prompt"
    torch.testing.assert_close(logits[0, :, 0], torch.full((6,), 0.5 + 2.5 * (2.0 - 0.5)))


def test_strategies_order_positions_by_their_definitions():
    probs = torch.tensor([[0.5, 0.4, 0.1], [0.6, 0.2, 0.2], [0.34, 0.33, 0.33]], dtype=torch.float64)
    prediction = predict_block(probs.log(), temperature=0.0, seed=0, step=0)  # the rows a step reads
    assert prediction[:, 0].tolist() == [0, 0, 0]
    uniform = torch.tensor([0.1, 0.9, 0.5], dtype=torch.float64)

    def order(name):
        return torch.sort(STRATEGIES[name](prediction, uniform), descending=True).indices.tolist()
    assert order("low_confidence") == [1, 0, 2]  # p(x0): .6 > .5 > .34
    assert order("margin") == [1, 0, 2]  # .4 > .1 > .01
    assert order("random") == [1, 2, 0]
    entropy = -(probs * probs.log()).sum(-1)
    assert order("entropy") == torch.sort(entropy).indices.tolist()


def test_threshold_unmasks_all_confident_positions_and_at_least_one():
    def confident(tokens, context):
        out = torch.zeros(tokens.shape[0], tokens.shape[1], VOCAB)
        out[:, :, 4] = 20.0  # every position is sure of token 4
        return out

    config = GenerationConfig(gen_length=8, steps=2, block_length=4, threshold=0.9)
    _, events = run(config, denoiser=confident)
    assert [len(e.unmasked) for e in events] == [4, 4]
    _, unsure = run(config, denoiser=lambda t, c: torch.zeros(t.shape[0], t.shape[1], VOCAB))
    assert [len(e.unmasked) for e in unsure] == [1] * 8


def test_stop_at_eos_skips_later_blocks():
    def eos_everywhere(tokens, context):
        out = torch.zeros(tokens.shape[0], tokens.shape[1], VOCAB)
        out[:, :, EOS] = 5.0
        return out

    config = GenerationConfig(gen_length=12, steps=6, block_length=4)
    _, events = run(config, denoiser=eos_everywhere, eos=(EOS,))
    assert len(events) == 2, "the first block ends with EOS, so the rest is not generated"
    _, all_events = run(config.replace(stop_at_eos=False), denoiser=eos_everywhere, eos=(EOS,))
    assert len(all_events) == 6


@pytest.mark.parametrize("kwargs, message", [
    (dict(gen_length=10, block_length=4), "divisible by block_length"),
    (dict(gen_length=8, block_length=4, steps=1), "at least the number of blocks"),
    (dict(gen_length=8, block_length=4, steps=3), "divisible by the number of blocks"),
    (dict(gen_length=8, block_length=4, steps=16), "exceeds block_length"),
    (dict(remasking="nope"), "unknown remasking"),
    (dict(threshold=1.5), "threshold"),
    (dict(parallel_window=0), "parallel_window"),
])
def test_bad_settings_raise_clear_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**kwargs)


def test_empty_prompt_is_rejected():
    sampler = DiffusionSampler(RandomDenoiser(), GenerationConfig(gen_length=4, steps=4, block_length=4), MASK)
    with pytest.raises(ValueError, match="empty"):
        sampler.initial_state([])


# ----- Picard windows ---------------------------------------------------------------------------
@pytest.mark.parametrize("window", [2, 3, 4, 8])
@pytest.mark.parametrize("remasking", list(STRATEGIES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_picard_windows_reproduce_the_sequential_trajectory(window, remasking, seed):
    config = GenerationConfig(gen_length=16, steps=8, block_length=8, remasking=remasking, temperature=0.8,
                              seed=seed, cfg_scale=0.5 if seed == 2 else 0.0)
    _, sequential = run(config, prompt=(1, 2, 3, seed))
    sampler, parallel = run(config.replace(parallel_window=window), prompt=(1, 2, 3, seed))
    assert [e.step for e in parallel] == list(range(len(sequential)))
    for a, b in zip(sequential, parallel):
        assert torch.equal(a.tokens, b.tokens)
    assert sampler.stats.denoiser_calls <= len(sequential)


@pytest.mark.parametrize("window", [2, 5])
def test_picard_with_threshold_decoding_is_exact(window):
    config = GenerationConfig(gen_length=16, steps=4, block_length=8, threshold=0.3, temperature=0.5)
    _, sequential = run(config)
    _, parallel = run(config.replace(parallel_window=window))
    assert torch.equal(sequential[-1].tokens, parallel[-1].tokens)
    assert len(sequential) == len(parallel)


def test_picard_window_that_never_converges_still_ends():
    """A denoiser whose output changes with every call: guesses never match, one state per iteration."""
    counter = {"n": 0}

    def fickle(tokens, context):
        counter["n"] += 1
        generator = torch.Generator().manual_seed(counter["n"])
        return torch.randn(tokens.shape[0], tokens.shape[1], VOCAB, generator=generator) * 5

    config = GenerationConfig(gen_length=8, steps=8, block_length=8, parallel_window=4)
    sampler, events = run(config, denoiser=fickle)
    assert len(events) == 8
    assert sampler.stats.denoiser_calls <= 8
    assert all(1 <= w.accepted <= 4 for w in sampler.stats.windows)
