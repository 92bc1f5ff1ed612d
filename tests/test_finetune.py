"""Fine-tuning through the swarm (issue 19): backward calls, soft-prompt adapters, the finetune command.

Gradients through real servers are compared with local autograd on the same weights (float32), also when a
server dies in the middle of a backward pass; adapters give the same tokens locally and through the swarm.
"""
from __future__ import annotations

import json
import shlex
import signal
import statistics
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from swarm.adapters.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterConfig, AdapterError, SoftPrompt, base_of
from swarm.client import DistributedDiffusionLM
from swarm.client.sequence import HopTrace
from swarm.diffusion.pipeline import CacheDirective
from swarm.finetune.__main__ import main as finetune_main
from swarm.finetune.data import load_examples, make_batch
from swarm.finetune.trainer import FinetuneConfig, Finetuner, sft_loss
from swarm.wire.messages import BackwardRequest, ErrorCode, ForwardRequest, RemoteError
from tests.conftest import holder_of, make_checkpoint, tiny_config, wait_seen

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5  # float32: max abs difference between swarm and local gradients
GENERATION = dict(gen_length=16, steps=16, block_length=8)


def adapter_for(lm, length: int = 4, seed: int = 0) -> SoftPrompt:
    config = AdapterConfig(length, lm.config.hidden_size, base_of(lm.config, lm.tokenizer))
    return SoftPrompt(config, torch.randn(length, lm.config.hidden_size, generator=torch.Generator().manual_seed(seed)))


def write_pairs(path, pairs) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in pairs))
    return str(path)


def sft_gradient(lm, tmp_path, prompts: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The SFT loss of a fixed batch and its gradient with respect to the prompt vectors."""
    examples = load_examples(write_pairs(tmp_path / "pairs.jsonl", [("12+7=", "19"), ("hello ", "world!")]),
                             lm.tokenizer, lm.config.eos_token_id)
    adapter = SoftPrompt(adapter_for(lm).config, prompts)
    loss = sft_loss(lm.backbone(), adapter, make_batch(examples, lm.config.eos_token_id),
                    torch.Generator().manual_seed(3))
    loss.backward()
    return loss.item(), adapter.prompts.grad


def client(local_swarm, path, **options) -> DistributedDiffusionLM:
    """A client of the shared swarm; ``dht=swarm_peer`` where its own peer id is not the point (a DHT peer of its own
    is ~1 CPU s)."""
    return DistributedDiffusionLM.from_pretrained(path, initial_peers=local_swarm.initial_peers, request_timeout=20,
                                                  **options)


def fast_server(local_swarm, path, blocks: str, *extra: str):
    """A server the route prefers (it announces a huge throughput)."""
    return local_swarm.start_server(str(path), blocks, "--throughput", "1e9", "--compute-threads", "1", *extra)


# ----- item 1: backward through the swarm ------------------------------------------------------------
def test_swarm_gradients_equal_local_autograd(remote_lm, local_lm, tmp_path):
    prompts = adapter_for(local_lm).prompts.detach()
    local_loss, local_grad = sft_gradient(local_lm, tmp_path, prompts)
    swarm_loss, swarm_grad = sft_gradient(remote_lm, tmp_path, prompts)
    assert local_grad.abs().max() > 1e-3  # a gradient that could be wrong
    assert swarm_loss == pytest.approx(local_loss, abs=1e-6)
    assert (swarm_grad - local_grad).abs().max().item() <= TOLERANCE


def kill_before_its_backward(local_swarm, lm, victim) -> list[str]:
    """SIGKILL ``victim`` just before ``lm``'s first backward call to it (the hops after it have answered by then);
    returns the list of peers called, filled as calls happen. Keyed on the peer, not on the call's number: on a
    loaded machine another server may answer the first hop, and a count would then kill a server nobody asked."""
    calls: list[str] = []
    backward = lm.caller.backward_all

    async def kill_first(peer_id, request, timeout):
        calls.append(peer_id)
        if peer_id == victim.peer_id and calls.count(peer_id) == 1:
            local_swarm.terminate(victim, signal.SIGKILL)
        return await backward(peer_id, request, timeout)

    lm.caller.backward_all = kill_first
    return calls


def test_a_server_killed_mid_backward_is_replaced_by_a_replica(local_swarm, tiny_model_path, local_lm, tmp_path,
                                                               swarm_peer):
    victim = fast_server(local_swarm, tiny_model_path, "0:2")
    lm = client(local_swarm, tiny_model_path, dht=swarm_peer)
    wait_seen(lm, [victim])  # the route holds the victim (a DHT read that missed it would plan around it)
    calls = kill_before_its_backward(local_swarm, lm, victim)
    try:
        prompts = adapter_for(local_lm).prompts.detach()
        _, swarm_grad = sft_gradient(lm, tmp_path, prompts)
        _, local_grad = sft_gradient(local_lm, tmp_path, prompts)
        assert calls.count(victim.peer_id) == 1, calls  # called once, dead by then: a replica answered instead
        assert any(event.peer_id == victim.peer_id for event in lm.sequence.failovers)
        assert (swarm_grad - local_grad).abs().max().item() <= TOLERANCE
    finally:
        lm.shutdown()


def test_a_hop_no_single_server_holds_any_more_is_recomputed_over_several(local_swarm, tiny_model_path, local_lm,
                                                                         swarm_peer):
    victim = fast_server(local_swarm, tiny_model_path, "0:4")
    lm = client(local_swarm, tiny_model_path, dht=swarm_peer)
    try:
        wait_seen(lm, [victim])  # the route holds the victim (a DHT read that missed it would plan around it)
        hidden = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
        trace: list[HopTrace] = []
        lm.sequence.forward(hidden, trace=trace)
        assert [(hop.peer_id, hop.start, hop.end) for hop in trace] == [(victim.peer_id, 0, 4)]
        local_swarm.terminate(victim, signal.SIGKILL)  # the fixture's servers hold 0:2, 2:4 and 1:4: none 0:4
        grad_output = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(2))
        grad = lm.sequence.backward(trace, grad_output)
        x = hidden.clone().requires_grad_(True)
        (expected,) = torch.autograd.grad(local_lm.model.span(x), x, grad_output)
        assert (grad - expected).abs().max().item() <= TOLERANCE
    finally:
        lm.shutdown()


def test_a_server_started_with_no_backward_refuses_and_a_replica_answers(local_swarm, tiny_model_path, local_lm,
                                                                        tmp_path, swarm_peer):
    refusing = fast_server(local_swarm, tiny_model_path, "0:2", "--no-backward")
    lm = client(local_swarm, tiny_model_path, dht=swarm_peer)
    try:
        request = BackwardRequest(0, 2, torch.randn(1, 3, 32), torch.randn(1, 3, 32))
        with pytest.raises(RemoteError, match="--no-backward") as refused:
            lm.loop.run(lm.caller.backward(refusing.peer_id, request, 10))
        assert refused.value.code == ErrorCode.NO_BACKWARD
        prompts = adapter_for(local_lm).prompts.detach()
        _, swarm_grad = sft_gradient(lm, tmp_path, prompts)
        _, local_grad = sft_gradient(local_lm, tmp_path, prompts)
        assert (swarm_grad - local_grad).abs().max().item() <= TOLERANCE
    finally:
        lm.shutdown()
        local_swarm.terminate(refusing)


def backward_call(lm, peer: str, request: ForwardRequest) -> torch.Tensor:
    """A raw backward RPC, as any peer could send it (the stacked tensor is not checked on this side)."""
    async def call():
        return await lm.caller._call(peer, lm.caller._forward_rpc(peer, request, backward=True), 10)

    return lm.loop.run(call())[0]


@pytest.mark.parametrize("case, code, message", [
    ("odd", ErrorCode.BAD_REQUEST, "must be even"),
    ("nan", ErrorCode.NOT_FINITE, "NaN"),
    ("cache", ErrorCode.BAD_REQUEST, "no cache, push or head"),
    ("blocks", ErrorCode.WRONG_SPAN, "holds"),
    ("large", ErrorCode.TOO_LARGE, "exceeds"),
])
def test_hostile_backward_requests_are_refused_clearly(remote_lm, case, code, message):
    server = holder_of(remote_lm, 0, 2)
    stacked = torch.randn(4, 3, 32)
    request = ForwardRequest(0, 2, stacked)
    if case == "odd":
        request.hidden = torch.randn(3, 3, 32)
    elif case == "nan":
        stacked[3, 1, 5] = float("nan")  # in the gradient half
    elif case == "cache":
        request.cache = CacheDirective(0)
    elif case == "blocks":
        request.end = 5
    elif case == "large":
        request.hidden = torch.zeros(2, 9000, 32)  # 18000 positions: over the default 16384
    with pytest.raises(RemoteError, match=message) as refused:
        backward_call(remote_lm, server, request)
    assert refused.value.code == code
    # the server still answers a good one
    good = BackwardRequest(0, 2, torch.randn(1, 3, 32), torch.randn(1, 3, 32))
    assert remote_lm.loop.run(remote_lm.caller.backward(server, good, 10)).shape == (1, 3, 32)


# ----- item 2: adapters ------------------------------------------------------------------------------
def test_an_adapter_gives_the_same_tokens_locally_and_through_the_swarm(remote_lm, local_lm, tmp_path):
    path = adapter_for(local_lm, length=6, seed=5).save(tmp_path / "adapter")
    plain = local_lm.generate("adapt", **GENERATION)
    for options in ({}, {"cache": "dual", "cache_refresh": 2}, {"remasking": "random", "parallel_window": 2}):
        local = local_lm.generate("adapt", adapter=str(path), **GENERATION, **options)
        swarm = remote_lm.generate("adapt", adapter=str(path), **GENERATION, **options)
        assert swarm.token_ids == local.token_ids, options
        assert swarm.info["adapter"] == {"name": str(path), "prompt_length": 6, "auto": False}
    assert local_lm.generate("adapt", adapter=str(path), **GENERATION).token_ids != plain.token_ids


def test_an_adapter_directory_that_changed_is_loaded_again(local_lm, tmp_path):
    """A process scoring a run that goes on training into the same directory sees each save (it was held once)."""
    path = str(adapter_for(local_lm, seed=1).save(tmp_path / "adapter"))
    first = local_lm.load_adapter(path)
    assert local_lm.load_adapter(path) is first, "unchanged: loaded once"
    adapter_for(local_lm, seed=2).save(tmp_path / "adapter")
    again = local_lm.load_adapter(path)
    assert torch.equal(again.prompts, adapter_for(local_lm, seed=2).prompts)
    assert not torch.equal(again.prompts, first.prompts)


def test_bad_adapters_are_refused_with_a_clear_error(local_lm, tmp_path):
    good = adapter_for(local_lm).save(tmp_path / "good")
    other = make_checkpoint(tmp_path / "other", tiny_config(hidden_size=64))
    from swarm.frontend.local import DiffusionLM

    foreign = adapter_for(DiffusionLM.from_pretrained(other)).save(tmp_path / "foreign")
    cases = {"missing": (tmp_path / "nowhere", "adapter.json is missing"),
             "foreign": (foreign, "another base model: hidden_size 64")}
    for name, edit, message in [
        ("kind", lambda d: _edit_json(d, kind="houlsby"), "unknown adapter kind"),
        ("length", lambda d: _edit_json(d, prompt_length=5), r"shape \(4, 32\).*expected \(5, 32\)"),
        ("nan", lambda d: save_file({"prompt": torch.full((4, 32), float("nan"))}, str(d / ADAPTER_WEIGHTS)),
         "NaN"),
        ("corrupt", lambda d: (d / ADAPTER_WEIGHTS).write_bytes(b"\xff" * 64), "not a valid safetensors"),
        ("huge", lambda d: (d / ADAPTER_WEIGHTS).write_bytes(b"\0" * (64 * 2**20 + 1)), "over the limit"),
        ("json", lambda d: (d / ADAPTER_CONFIG).write_text("{"), "not valid JSON"),
    ]:
        directory = SoftPrompt.load(good).save(tmp_path / name)
        edit(directory)
        cases[name] = (directory, message)
    for name, (directory, message) in cases.items():
        with pytest.raises(AdapterError, match=message):
            local_lm.generate("x", adapter=str(directory), gen_length=8, steps=2, block_length=8)
    with pytest.raises(AdapterError, match="context"):
        local_lm.generate("x", adapter=str(good), gen_length=508, steps=2, block_length=508)


def _edit_json(directory, **changes) -> None:
    path = directory / ADAPTER_CONFIG
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **changes)))


# ----- the command -----------------------------------------------------------------------------------
def run_finetune(*args: str) -> str:
    result = CliRunner().invoke(finetune_main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def mean_loss(trainer: Finetuner, draws: int = 16) -> float:
    """The SFT loss of every example, averaged over fixed masking draws (the training loss is too noisy)."""
    batch = make_batch(trainer.examples, trainer.lm.config.eos_token_id)
    generator = torch.Generator().manual_seed(123)
    with torch.no_grad():
        return sum(sft_loss(trainer.backbone, trainer.adapter, batch, generator).item() for _ in range(draws)) / draws


def test_finetuning_lowers_the_loss(local_lm, tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", [("2+2=", "4"), ("3+4=", "7"), ("hi ", "there")])
    trainer = Finetuner(local_lm, FinetuneConfig(data, str(tmp_path / "run"), steps=40, lr=0.05, batch_size=3,
                                                 prompt_length=4))
    before = mean_loss(trainer)
    trainer.run(progress=False)
    after = mean_loss(trainer)
    assert after < 0.7 * before, (before, after)


def test_max_grad_norm_clips_what_the_optimizer_sees(local_lm, tmp_path):
    """--max-grad-norm: every step's gradient reaches Adam at most that long; without it, as computed."""
    data = write_pairs(tmp_path / "pairs.jsonl", [("2+2=", "4"), ("3+4=", "7"), ("hi ", "there")])
    seen: dict[float, list[float]] = {}
    for limit in (0.0, 1e-3):
        norms = seen.setdefault(limit, [])

        class Recording(torch.optim.Adam):
            def step(self, closure=None):
                norms.append(torch.cat([p.grad.reshape(-1) for g in self.param_groups for p in g["params"]]).norm())
                return super().step(closure)

        config = FinetuneConfig(data, str(tmp_path / f"run{limit}"), steps=3, lr=0.05, batch_size=3,
                                prompt_length=4, max_grad_norm=limit)
        Finetuner(local_lm, config, optimizer_factory=lambda params: Recording(params, lr=0.05)).run(progress=False)
    assert len(seen[0.0]) == len(seen[1e-3]) == 3
    assert min(seen[0.0]) > 1e-2 and max(seen[1e-3]) <= 1e-3 * (1 + 1e-4)


@pytest.mark.parametrize("setting", [{"down_scale": 0.0}, {"down_scale": float("nan")}, {"max_grad_norm": -1.0},
                                     {"max_grad_norm": float("inf")}])
def test_bad_trainer_settings_are_refused_naming_them(setting):
    name = next(iter(setting))
    with pytest.raises(ValueError, match=name):
        FinetuneConfig("pairs.jsonl", "out", **setting)


def quick_start_arguments() -> list[str]:
    """The arguments of the first ``swarm.finetune`` command of docs/TRAINING.md's quick start."""
    section = (ROOT / "docs" / "TRAINING.md").read_text().split("## Quick start", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    command = next(line for line in block.splitlines() if line.startswith("python -m swarm.finetune "))
    return shlex.split(command, comments=True)[3:]


def with_option(args: list[str], name: str, value: str) -> list[str]:
    """``args`` with ``name value``, replacing the value it had."""
    if name not in args:
        return [*args, name, value]
    index = args.index(name)
    return [*args[:index + 1], value, *args[index + 2:]]


def test_the_quick_start_lowers_the_loss(tmp_path, monkeypatch):
    """The quick start's first command, on its example data, shortened to 15 steps: the loss falls clearly (with
    the two pairs and the settings it once had, it went from 7.1 to 8.7 in 100 steps; docs/TRAINING.md). At 15 steps
    the last five average 0.15 of the first five (seeded: 11.2 -> 1.7); at 25, 0.06."""
    args = quick_start_arguments()
    assert "--initial-peers" not in args and "--model" not in args  # the embedded model, all in this process
    monkeypatch.chdir(ROOT)  # the data path is the repository's
    args = with_option(with_option(args, "--output", str(tmp_path / "adapter")), "--steps", "15")
    run_finetune(*args, "--threads", "1")
    losses = json.loads((tmp_path / "adapter" / "losses.json").read_text())
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    assert len(losses) == 15 and last < 0.3 * first, (first, last)


def test_finetune_command_resumes_exactly(tiny_model_path, tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", [("2+2=", "4"), ("3+4=", "7"), ("hi ", "there")])
    common = ["--model", str(tiny_model_path), "--data", data, "--batch-size", "3", "--lr", "0.05",
              "--prompt-length", "4", "--save-every", "3"]
    run_finetune(*common, "--output", str(tmp_path / "straight"), "--steps", "8")
    run_finetune(*common, "--output", str(tmp_path / "resumed"), "--steps", "4")
    output = run_finetune(*common, "--output", str(tmp_path / "resumed"), "--steps", "8")
    assert "8 steps" in output
    straight, resumed = (SoftPrompt.load(tmp_path / name) for name in ("straight", "resumed"))
    assert torch.equal(straight.prompts, resumed.prompts)
    config = json.loads((tmp_path / "straight" / ADAPTER_CONFIG).read_text())
    assert config["training"]["steps"] == 8 and config["base"]["hidden_size"] == 32
    changed = CliRunner().invoke(finetune_main, [*common, "--output", str(tmp_path / "straight"), "--lr", "0.1"])
    assert changed.exit_code != 0 and "other settings (lr: 0.05 -> 0.1)" in changed.output


def test_a_learning_rate_schedule_may_change_only_the_steps_to_come(tiny_model_path, tmp_path):
    """--lr-from STEP:LR: a run resumed at step 3 with a new rate from step 3 on is the run planned that way from the
    start (bit for bit); changing the rate of a step already taken is refused, naming it."""
    data = write_pairs(tmp_path / "pairs.jsonl", [("2+2=", "4"), ("3+4=", "7"), ("hi ", "there")])
    common = ["--model", str(tiny_model_path), "--data", data, "--batch-size", "3", "--lr", "0.05",
              "--prompt-length", "4", "--save-every", "3"]
    run_finetune(*common, "--output", str(tmp_path / "planned"), "--steps", "6", "--lr-from", "3:0.005")
    run_finetune(*common, "--output", str(tmp_path / "annealed"), "--steps", "3")
    run_finetune(*common, "--output", str(tmp_path / "annealed"), "--steps", "6", "--lr-from", "3:0.005")
    run_finetune(*common, "--output", str(tmp_path / "constant"), "--steps", "6")
    planned, annealed, constant = (SoftPrompt.load(tmp_path / name) for name in ("planned", "annealed", "constant"))
    assert torch.equal(planned.prompts, annealed.prompts)
    assert not torch.equal(planned.prompts, constant.prompts)
    training = json.loads((tmp_path / "planned" / ADAPTER_CONFIG).read_text())["training"]
    assert training["lr"] == 0.05 and training["lr_from"] == [[3, 0.005]]
    changed = CliRunner().invoke(finetune_main, [*common, "--output", str(tmp_path / "planned"), "--steps", "8",
                                                 "--lr-from", "2:0.005"])
    assert changed.exit_code != 0 and "lr at step 2: 0.05 -> 0.005" in changed.output
    bad = CliRunner().invoke(finetune_main, [*common, "--output", str(tmp_path / "x"), "--lr-from", "3:-1"])
    assert bad.exit_code != 0 and "LR a positive number" in bad.output


def test_finetune_through_the_swarm(local_swarm, tiny_model_path, local_lm, tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", [("1+1=", "2"), ("5+3=", "8")])
    output = tmp_path / "adapter"
    peers = [arg for peer in local_swarm.initial_peers for arg in ("--initial-peers", peer)]
    run_finetune("--model", str(tiny_model_path), *peers, "--data", data, "--output", str(output), "--steps", "2",
                 "--batch-size", "2", "--prompt-length", "3")
    config = json.loads((output / ADAPTER_CONFIG).read_text())
    assert config["training"]["through_swarm"] is True and config["training"]["steps"] == 2
    assert local_lm.generate("1+1=", adapter=str(output), gen_length=8, steps=8, block_length=8).finish_reason
