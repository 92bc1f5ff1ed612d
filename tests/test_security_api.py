"""A hostile client: oversized, infinite and NaN settings, and requests abandoned mid-generation (issue 16).

Every bound is refused before any compute, with a 400 over HTTP and a ValueError from the Python API, the same
message from both front ends; a dropped request of either kind stops its generation.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from typing import Any, Iterator
from urllib.parse import urlparse

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

pytest.importorskip("uvicorn", reason="the API needs fastapi and uvicorn")

from swarm.api import GenerationEngine, create_app, load_engine  # noqa: E402
from swarm.diffusion.config import MAX_PARALLEL_WINDOW, GenerationConfig, GenerationLimits  # noqa: E402
from swarm.frontend.lm import BaseDiffusionLM  # noqa: E402
from swarm.frontend.local import DiffusionLM  # noqa: E402
from tests.test_api import http, serve  # noqa: E402

MODEL = "tiny"
LONG = "x" * 2000
# (extra body fields, the message they must get); the tiny model has 512 positions and "hi" is 3 tokens.
OVERSIZED = [
    ({"parallel_window": 1_000_000}, "parallel_window must be 1..32"),
    ({"parallel_window": MAX_PARALLEL_WINDOW + 1}, "parallel_window must be 1..32"),
    ({"max_tokens": 1_000_000}, "the model's context of 512 positions"),
    ({"max_tokens": 510}, "prompt (3 tokens) + gen_length (510) exceeds"),
    ({"gen_length": 10**30}, "the model's context of 512 positions"),
    ({"max_tokens": 64, "steps": 10**9}, "exceeds block_length"),
    ({"max_tokens": 64, "block_length": 10**9}, "divisible by block_length"),
    ({"max_tokens": 64, "cache": "dual", "cache_refresh": 10**9}, "cache_refresh must be 0..64"),
    ({"seed": 2**64}, "seed must be 0..9223372036854775807"),
    ({"staleness": 10**6}, "staleness must be 0..8"),
    ({"temperature": 1e6}, "temperature must be a finite number in [0, 10]"),
    ({"cfg_scale": 1e6}, "cfg_scale must be a finite number in [0, 10]"),
    ({"threshold": 2.0}, "threshold must be a finite number in (0, 1]"),
    ({"experts": {f"e{i}": 1.0 for i in range(9)}}, "at most 8 experts per request, got 9"),
    ({"experts": {"code": 1e6}}, "the weight of expert 'code' must be a finite number in [0, 10]"),
    ({"experts": {LONG: 1.0}}, "expert names must be strings of 1..1024 characters"),
    ({"experts": "everything"}, "experts must be 'auto' or a mapping"),
    # 2 (cfg) x 4 (window) rows x 451 positions > the 2048 this engine's budget allows
    ({"max_tokens": 448, "cfg_scale": 1.0, "parallel_window": 4}, "sequence positions in memory at once"),
]
# raw JSON (Python's json, which FastAPI uses, reads Infinity and NaN): (body fragment, message)
NON_FINITE = [
    ('"temperature": Infinity', "temperature must be a finite number"),
    ('"temperature": NaN', "temperature must be a finite number"),
    ('"cfg_scale": Infinity', "cfg_scale must be a finite number"),
    ('"cfg_scale": -Infinity', "cfg_scale must be a finite number"),
    ('"threshold": NaN', "threshold must be a finite number"),
    ('"experts": {"code": NaN}', "the weight of expert 'code' must be a finite number"),
    ('"experts": {"code": Infinity}', "the weight of expert 'code' must be a finite number"),
]
# what only the Python API can pass (the HTTP schema has no such field, or its types stop it first)
PYTHON_ONLY = [
    ({"expert_tau": float("inf")}, "expert_tau must be a finite number in (0, 1000]"),
    ({"expert_tau": float("nan")}, "expert_tau must be a finite number"),
    ({"expert_tau": 0.0}, "expert_tau must be a finite number in (0, 1000]"),
    ({"corrector_steps": 1000}, "corrector_steps must be 0..8"),
    ({"corrector_steps": 1.5}, "corrector_steps must be an integer"),
    ({"temperature": "hot"}, "temperature must be a finite number"),
    ({"parallel_window": 2.0}, "parallel_window must be an integer"),
    ({"remasking": ["random"]}, "unknown remasking"),
    ({"scale": ["max"]}, "unknown scale"),
    ({"stop_at_eos": "no"}, "stop_at_eos must be true or false"),
]


def small_budget(lm: BaseDiffusionLM, positions: int) -> GenerationLimits:
    """Limits of ``lm`` whose memory budget holds ``positions`` sequence positions (never below one full row)."""
    limits = GenerationLimits.for_model(lm.config)
    return GenerationLimits(limits.max_positions, limits.bytes_per_token, positions * limits.bytes_per_token)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def post_raw(url: str, body: bytes, path: str = "/v1/completions") -> socket.socket:
    """Send a request on a raw socket and return it unread: closing it is a client that hangs up."""
    address = urlparse(url)
    sock = socket.create_connection((address.hostname, address.port), timeout=30)
    head = (f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    sock.sendall(head.encode() + body)
    return sock


def wait_for(condition, timeout: float, what: str) -> float:
    """Seconds until ``condition()`` holds; fails after ``timeout``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_path) -> DiffusionLM:
    """The tiny model with a memory budget of 2048 positions (4 full sequences), so that the budget is reachable."""
    lm = DiffusionLM.from_pretrained(tiny_model_path)
    lm.limits = small_budget(lm, 2048)
    return lm


@pytest.fixture(scope="module")
def tiny_url(tiny_lm) -> Iterator[str]:
    with serve(create_app(GenerationEngine(tiny_lm, MODEL))) as url:
        yield url


def ask(url: str, fields: dict[str, Any]) -> tuple[int, dict, float]:
    started = time.monotonic()
    status, body = http(f"{url}/v1/completions", {"model": MODEL, "prompt": "hi", **fields})
    return status, body, time.monotonic() - started


# ----- bounds over HTTP ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, message", OVERSIZED, ids=[json.dumps(f)[:60] for f, _ in OVERSIZED])
def test_oversized_settings_are_refused_fast_with_400(tiny_lm, tiny_url, fields, message):
    passes = []  # every forward of the model (a denoiser call, an embedding) would pass here
    hook = tiny_lm.model.register_forward_pre_hook(lambda module, args: passes.append(1))
    try:
        status, body, _ = ask(tiny_url, fields)
    finally:
        hook.remove()
    assert status == 400 and message in body["error"]["message"], body
    assert body["error"]["type"] == "invalid_request_error"
    assert passes == [], "refused only after computing: the bounds are checked before any forward"


def test_the_refusal_names_the_setting(tiny_url):
    _, body, _ = ask(tiny_url, {"parallel_window": 1_000_000})
    assert body["error"]["param"] == "parallel_window"
    _, body, _ = ask(tiny_url, {"experts": {"code": 1e6}})
    assert body["error"]["param"] == "experts"


@pytest.mark.parametrize("fragment, message", NON_FINITE, ids=[f for f, _ in NON_FINITE])
def test_infinity_and_nan_are_refused(tiny_url, fragment, message):
    raw = ('{"model": "%s", "prompt": "hi", "max_tokens": 8, %s}' % (MODEL, fragment)).encode()
    status, body = http(f"{tiny_url}/v1/completions", raw=raw)
    assert status == 400 and message in body["error"]["message"], body


def test_oversized_requests_leave_no_memory_behind(tiny_url):
    """The attack of the report (a window of a million states) once cost 17 GB; refused, it costs nothing."""
    ask(tiny_url, OVERSIZED[0][0])  # warm up the code paths once
    before = resident_bytes()
    for fields, _ in OVERSIZED * 3:
        assert ask(tiny_url, fields)[0] == 400
    grown = resident_bytes() - before
    assert grown < 32 << 20, f"the process grew by {grown >> 20} MiB answering refused requests"


def test_the_chat_endpoint_has_the_same_bounds(tiny_url):
    messages = [{"role": "user", "content": "hi"}]
    status, body = http(f"{tiny_url}/v1/chat/completions",
                        {"model": MODEL, "messages": messages, "parallel_window": 1_000_000})
    assert status == 400 and "parallel_window must be 1..32" in body["error"]["message"]


def test_a_huge_bad_value_is_not_echoed_back_whole(tiny_url):
    status, body, _ = ask(tiny_url, {"remasking": "x" * 100_000})
    assert status == 400 and "unknown remasking" in body["error"]["message"]
    assert len(body["error"]["message"]) < 300


def test_too_many_or_too_long_stop_sequences(tiny_url):
    status, body, _ = ask(tiny_url, {"stop": ["a", "b", "c", "d", "e"]})
    assert status == 400 and "at most 4 stop sequences" in body["error"]["message"]
    status, body, _ = ask(tiny_url, {"stop": LONG})
    assert status == 400 and "at most 1000 characters" in body["error"]["message"]


def test_requests_at_the_bounds_are_served(tiny_url):
    for fields in ({"max_tokens": 8, "parallel_window": MAX_PARALLEL_WINDOW, "temperature": 10.0, "cfg_scale": 10.0},
                   {"max_tokens": 448, "cfg_scale": 1.0, "parallel_window": 2, "steps": 14, "block_length": 448}):
        status, body, _ = ask(tiny_url, fields)
        assert status == 200, body


# ----- the Python API refuses the same values --------------------------------------------------------
def python_cases() -> list[tuple[dict[str, Any], str]]:
    cases = [({("gen_length" if k == "max_tokens" else k): v for k, v in fields.items()}, message)
             for fields, message in OVERSIZED]
    for fragment, message in NON_FINITE:
        name, value = fragment.split(": ", 1)
        cases.append(({json.loads(name): json.loads(value)}, message))
    return cases + PYTHON_ONLY


@pytest.mark.parametrize("settings, message", python_cases())
def test_generate_refuses_the_same_values(tiny_lm, settings, message):
    with pytest.raises(ValueError) as refused:
        next(tiny_lm.generate_stream("hi", **settings))
    assert message in str(refused.value)


def test_the_swarm_client_goes_through_the_same_check(remote_lm, monkeypatch):
    """No request leaves the client: every case is refused by the shared check before any route is used."""
    monkeypatch.setattr(remote_lm, "limits", small_budget(remote_lm, 2048))
    for settings, message in python_cases():
        with pytest.raises(ValueError) as refused:
            remote_lm.generate("hi", **settings)
        assert message in str(refused.value), settings


def test_a_window_the_scale_chose_shrinks_to_the_budget(remote_lm, monkeypatch):
    """``scale="auto"`` picks a window of 4 for random remasking; a small budget fits it instead of refusing."""
    prompt = remote_lm.encode_prompt("hi")
    request = remote_lm.check_request(prompt, remasking="random", gen_length=448)
    assert request.generation.parallel_window == 4
    monkeypatch.setattr(remote_lm, "limits", small_budget(remote_lm, 1500))
    request = remote_lm.check_request(prompt, remasking="random", gen_length=448)
    assert request.generation.parallel_window == 3  # 3 x 451 positions fit in 1500, 4 x 451 do not
    with pytest.raises(ValueError, match="would hold 1804 sequence positions"):  # asked for by the caller: refused
        remote_lm.check_request(prompt, remasking="random", gen_length=448, parallel_window=4)


def test_limits_follow_the_model_and_the_machine(tiny_lm):
    limits = GenerationLimits.for_model(tiny_lm.config)
    assert limits.max_positions == 512 and limits.memory_budget > 0
    assert limits.bytes_per_token == 4 * (2 * 260 + 12 * 32 + 4 * 64)
    starved = GenerationLimits(512, limits.bytes_per_token, memory_budget=1)
    assert starved.max_resident_tokens == 512  # one full sequence is always allowed
    starved.check(GenerationConfig(gen_length=509, steps=509, block_length=509), prompt_length=3)
    with pytest.raises(ValueError, match="would hold 1024"):
        starved.check(GenerationConfig(gen_length=509, steps=509, block_length=509, cfg_scale=1.0), prompt_length=3)


def test_the_api_flag_sets_the_memory_budget(tiny_model_path):
    """``--request-memory-mb`` reaches the model's limits (a tiny budget still allows one full sequence)."""
    engine = load_engine(str(tiny_model_path), local=True, request_memory_mb=1)
    assert engine.lm.limits.memory_budget == 1 << 20 and engine.lm.limits.max_resident_tokens == 512
    with pytest.raises(ValueError, match="would hold 1028 sequence positions"):  # the prompt counts as 1 token here
        engine.check_settings({"gen_length": 256, "cfg_scale": 1.0, "parallel_window": 2})


def test_a_local_api_loads_only_the_experts_it_serves(tiny_model_path, tmp_path):
    """A caller of a local API cannot make it load a checkpoint directory it names: only the embedded experts
    and those the operator allowed (``--allow-expert``) are served; anything else is a 400 before any load."""
    engine = load_engine(str(tiny_model_path), local=True, allow_experts=[str(tmp_path)])
    with serve(create_app(engine)) as url:
        status, body = http(f"{url}/v1/completions",
                            {"model": engine.model_id, "prompt": "hi", "experts": {str(tiny_model_path): 1.0}})
        assert status == 400 and "not served here" in body["error"]["message"], body
        assert body["error"]["param"] == "experts"
    assert not engine.lm._experts, "nothing was loaded"
    engine.check_settings({"experts": {"code": 1.0, str(tmp_path): 0.5}})  # embedded and allowed names pass


# ----- abandoned requests ---------------------------------------------------------------------------------
SLOW = {"prompt": "Once upon a time", "max_tokens": 512, "steps": 16, "block_length": 512}  # ~0.3 s a step


@pytest.fixture(scope="module")
def default_lm() -> DiffusionLM:
    """The embedded default model: at 530 positions a step takes a few hundred ms, long enough to hang up."""
    return DiffusionLM.from_pretrained("default")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_dropped_requests_stop_their_generation(default_lm, stream, caplog):
    """A running and a queued request are dropped: both are cancelled and the model is free at once."""
    caplog.set_level("INFO", logger="swarm.api.engine")
    engine = GenerationEngine(default_lm, "default")
    stats = engine.stats
    body = json.dumps({"model": "default", "stream": stream, **SLOW}).encode()
    with serve(create_app(engine)) as url:
        running = post_raw(url, body)
        wait_for(lambda: stats.steps >= 1, 60, "the first step")
        queued = post_raw(url, body)
        wait_for(lambda: engine.pending == 2, 10, "the second request to queue")
        queued.close()
        running.close()
        at_hang_up = stats.steps
        stopped_in = wait_for(lambda: engine.pending == 0, 10, "both requests to stop")
        ran = stats.steps
        assert stats.cancelled == 2 and stats.finished == 0
        assert ran < SLOW["steps"], "the dropped request ran to the end"  # and the queued one never started
        assert "request cancelled before it got the model" in caplog.text
        started = time.monotonic()
        status, answer = http(f"{url}/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 8})
        assert status == 200 and answer["choices"][0]["finish_reason"]
        assert stats.finished == 1
    print(f"{'streamed' if stream else 'plain'}: dropped requests stopped {stopped_in:.2f} s after the hang-up, "
          f"{ran - at_hang_up} step(s) later, "
          f"after {ran} of {SLOW['steps']} steps; the next request took {time.monotonic() - started:.2f} s")


# ----- request bodies -------------------------------------------------------------------------------------
def read_answer(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of the one answer on ``sock``."""
    data = b""
    with sock:
        sock.settimeout(30)
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                re.search(rb"content-length: (\d+)", data.lower()).group(1)):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def test_an_oversized_body_is_refused_before_it_is_read(tiny_url):
    """A declared 100 MB body: 413 at once, without the server waiting for (or holding) the bytes."""
    address = urlparse(tiny_url)
    sock = socket.create_connection((address.hostname, address.port), timeout=30)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {100 << 20}\r\n\r\n{{\"prompt\": \"".encode())
    status, body = read_answer(sock)
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert "limit is 1048576 bytes" in body["error"]["message"]


def test_an_oversized_chunked_body_is_refused_while_it_arrives(tiny_url):
    """No Content-Length (chunked): the bytes are counted as they come and the request refused past the cap."""
    address = urlparse(tiny_url)
    sock = socket.create_connection((address.hostname, address.port), timeout=30)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n".encode())
    piece = b"x" * 65536
    try:
        for _ in range(32):  # 2 MiB in all, twice the cap
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed before the client finished: also a refusal
    status, body = read_answer(sock)
    assert status == 413 and body["error"]["code"] == "request_too_large", body


def test_a_body_under_the_cap_is_served_as_before(tiny_url):
    """Half the cap (JSON whitespace, so the prompt still fits the tiny model) is read and answered."""
    fields = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4}).encode()
    status, body = read_answer(post_raw(tiny_url, fields[:-1] + b" " * (512 << 10) + b"}"))
    assert status == 200 and isinstance(body["choices"][0]["text"], str), body


# ----- text that is not Unicode, bodies that are not UTF-8 (issue 33, item 7) -------------------------------
LONE_SURROGATE = '"hi \\ud800 there"'  # valid JSON, and a Python str no tokenizer can encode


@pytest.fixture(scope="module")
def default_url(default_lm) -> Iterator[str]:
    """The default model's API: its subword tokenizer (Rust) is the one a lone surrogate used to crash (500)."""
    with serve(create_app(GenerationEngine(default_lm, "default"))) as url:
        yield url


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", '{"model": "default", "max_tokens": 4, "prompt": %s}'),
    ("/v1/completions", '{"model": "default", "max_tokens": 4, "prompt": [%s]}'),
    ("/v1/chat/completions", '{"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": %s}]}'),
    ("/v1/chat/completions", '{"model": "default", "max_tokens": 4, '
                             '"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}'),
], ids=["prompt", "prompt-list", "chat", "chat-parts"])
def test_a_lone_surrogate_is_a_400_not_a_500(default_url, path, body):
    status, answer = read_answer(post_raw(default_url, (body % LONE_SURROGATE).encode(), path))
    assert status == 400, answer
    assert "lone surrogate (U+D800)" in answer["error"]["message"], answer


def test_the_python_api_refuses_a_lone_surrogate_the_same_way(default_lm):
    with pytest.raises(ValueError, match=r"character 3 is a lone surrogate \(U\+D800\)"):
        default_lm.generate("hi \ud800", gen_length=4, steps=4, block_length=4)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "latin-1"])
def test_a_body_not_in_utf8_is_refused(tiny_url, encoding):
    """JSON over HTTP is UTF-8: other encodings (which Python's json would guess and read) get a 400."""
    text = json.dumps({"model": MODEL, "prompt": "caf\u00e9", "max_tokens": 4}, ensure_ascii=False)
    status, answer = read_answer(post_raw(tiny_url, text.encode(encoding)))
    assert status == 400 and answer["error"]["code"] == "invalid_encoding", answer
    status, answer = read_answer(post_raw(tiny_url, text.encode("utf-8")))  # the same body in UTF-8 is served
    assert status == 200, answer


@hypothesis_settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.characters(codec=None)), raw=st.binary(max_size=64))
def test_text_and_body_checks_never_raise_anything_else(text, raw):
    """Any str (surrogates included) is either tokenizable text or a ValueError; any bytes either UTF-8 without
    NUL (which is what Python's json then reads as UTF-8) or a reason."""
    from swarm.api.body_limit import encoding_problem
    from swarm.models.tokenizer import ByteTokenizer

    try:
        assert ByteTokenizer().encode(text) == list(text.encode("utf-8"))
    except ValueError as error:
        assert "lone surrogate" in str(error)
    problem = encoding_problem(raw)
    assert (problem is None) == (b"\x00" not in raw and _is_utf8(raw))


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
