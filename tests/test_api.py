"""The OpenAI-style HTTP API, driven by the official ``openai`` client, over the live local swarm."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import IO, Any, Iterator

import pytest

openai = pytest.importorskip("openai", reason='the API tests need the openai client (pip install -e ".[test]")')
uvicorn = pytest.importorskip("uvicorn", reason="the API needs fastapi and uvicorn")

from click.testing import CliRunner  # noqa: E402

from swarm.api import GenerationEngine, create_app, load_engine  # noqa: E402
from swarm.api.__main__ import main as api_main  # noqa: E402
from swarm.api.engine import EngineBusy  # noqa: E402
from swarm.api.errors import as_api_error  # noqa: E402
from swarm.client import MissingBlocksError  # noqa: E402
from swarm.dht.schema import default_prefix  # noqa: E402
from tests.conftest import wait_until  # noqa: E402

SETTINGS = dict(gen_length=16, steps=8, block_length=8, seed=3, temperature=1.0, remasking="random")
EXTRA = {"steps": 8, "block_length": 8, "remasking": "random"}  # what the OpenAI API has no field for


@contextlib.contextmanager
def serve(app) -> Iterator[str]:
    """Run ``app`` with uvicorn in a thread on a free loopback port; stop it on exit."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def make_client(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def http(url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, dict]:
    """A plain request (GET without a body), for what the openai client will not send: broken bodies."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def model_id(tiny_model_path) -> str:
    return default_prefix(tiny_model_path)


@pytest.fixture(scope="module")
def engine(remote_lm, model_id) -> GenerationEngine:
    return GenerationEngine(remote_lm, model_id)  # remote_lm's fixture closes the swarm connection


@pytest.fixture(scope="module")
def api_url(engine) -> Iterator[str]:
    with serve(create_app(engine)) as url:
        yield url


@pytest.fixture(scope="module")
def client(api_url):
    return make_client(api_url)


def test_models_and_health(client, api_url, model_id):
    assert [model.id for model in client.models.list().data] == [model_id]
    status, report = http(f"{api_url}/health")
    assert status == 200 and report["status"] == "ok" and report["mode"] == "swarm"
    assert report["uncovered"] == [] and report["servers"] >= 3


def test_completion_equals_distributed_and_local(client, remote_lm, local_lm, model_id):
    completion = client.completions.create(model=model_id, prompt="Hello there", max_tokens=16, seed=3,
                                           temperature=1.0, extra_body=EXTRA)
    local = local_lm.generate("Hello there", **SETTINGS)
    remote = remote_lm.generate("Hello there", **SETTINGS)
    assert completion.choices[0].text == local.text == remote.text
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert completion.model == model_id and completion.created > 0
    assert completion.choices[0].finish_reason == ("stop" if local.finish_reason == "eos" else "length")
    assert completion.usage.prompt_tokens == len(local.prompt_ids)
    assert completion.usage.completion_tokens == len(local.token_ids)
    assert completion.diffusion["steps"] == local.steps and completion.diffusion["info"]["route"]


def test_stream_sends_every_denoising_step(client, local_lm, model_id):
    stream = client.completions.create(model=model_id, prompt="Hello there", max_tokens=16, seed=3, temperature=1.0,
                                       stream=True, stream_options={"include_usage": True}, extra_body=EXTRA)
    chunks = list(stream)
    expected = local_lm.generate("Hello there", **SETTINGS)
    canvases = [c.choices[0].diffusion for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert [c["step"] for c in canvases] == list(range(8))
    assert [c["masked_left"] for c in canvases] == [14, 12, 10, 8, 6, 4, 2, 0]  # 2 tokens per step
    assert canvases[0]["text"].count("_") >= 14  # masks are shown as "_"
    # A plain OpenAI consumer concatenates the deltas and gets exactly the final text.
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert final.choices[0].text == expected.text and len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_completion_and_its_stream(client, local_lm, model_id):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt_ids = GenerationEngine(local_lm, model_id).chat_prompt(messages)  # byte model: plain transcript
    expected = local_lm.generate(prompt_ids, gen_length=8, steps=8, block_length=8, seed=1)
    chat = client.chat.completions.create(model=model_id, messages=messages, max_completion_tokens=8, seed=1)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == expected.text
    chunks = list(client.chat.completions.create(model=model_id, messages=messages, max_tokens=8, seed=1, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert len([c for c in chunks if c.choices[0].finish_reason is None]) == 8


BAD_REQUESTS = [
    ("completions", {}, 400, "prompt: Field required"),
    ("completions", {"prompt": 5}, 400, "prompt: expected"),
    ("completions", {"prompt": "hi", "steps": "many"}, 400, "steps"),
    ("completions", {"prompt": "hi", "max_tokens": 8.5}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 10, "block_length": 4}, 400, "divisible by block_length"),
    ("completions", {"prompt": "hi", "remasking": "sideways"}, 400, "unknown remasking"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature must be a finite number in [0, 10]"),
    ("completions", {"prompt": "hi", "max_tokens": 16, "gen_length": 8}, 400, "disagree"),
    ("completions", {"prompt": "hi", "n": 2}, 400, "n=1"),
    ("completions", {"prompt": ""}, 400, "prompt is empty"),
    ("completions", {"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("completions", {"prompt": [1, 99999]}, 400, "outside the vocabulary"),
    ("completions", {"prompt": "hi", "max_tokens": 1024}, 400, "exceeds the model's context"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "'gpt-4' does not exist"),
    ("completions", {"prompt": "hi", "max_tokens": 8, "scale": "huge"}, 400, "unknown scale"),
    ("completions", {"prompt": "hi", "max_tokens": 8, "tier": "secret"}, 400, "unknown tier"),
    ("completions", {"prompt": "my password", "max_tokens": 8}, 400, "trusted_peers"),
    ("completions", {"prompt": "hi", "max_tokens": 8, "experts": {"nonexistent": 1.0}}, 503, "nonexistent"),
    ("completions", {"prompt": "hi", "max_tokens": 8, "staleness": 9}, 400, "staleness must be 0..8"),
    ("completions", {"prompt": "hi", "max_tokens": 8, "staleness": 2, "stale_check": "maybe"}, 400,
     "unknown stale_check"),
    ("completions", {"prompt": "hi", "max_tokens": 8, "cache": "triple"}, 400, "unknown cache"),
    ("completions", {"prompt": "hi", "max_tokens": 8, "cache_refresh": -1}, 400, "cache_refresh"),
    ("chat/completions", {}, 400, "messages: Field required"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("chat/completions", {"messages": []}, 400, "messages"),
]


@pytest.mark.parametrize("path, body, status, message", BAD_REQUESTS)
def test_bad_requests_get_clear_4xx(api_url, model_id, path, body, status, message):
    got_status, got = http(f"{api_url}/v1/{path}", {"model": model_id, **body})
    assert got_status == status, got
    assert message in got["error"]["message"]
    assert got["error"]["type"] == ("invalid_request_error" if status < 500 else "service_unavailable")


def test_broken_json_and_unknown_routes(api_url):
    assert http(f"{api_url}/v1/completions", raw=b"{not json")[0] == 400
    status, body = http(f"{api_url}/v1/nothing-here")
    assert status == 404 and body["error"]["message"] == "Not Found"


def test_openai_client_raises_its_typed_errors(client, model_id):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="divisible"):
        client.completions.create(model=model_id, prompt="hi", max_tokens=10, extra_body={"block_length": 4})


def test_concurrent_requests_each_get_their_own_result(client, local_lm, model_id):
    results: dict[int, str] = {}

    def ask(seed: int) -> None:
        results[seed] = client.completions.create(model=model_id, prompt="The cat", max_tokens=16, seed=seed,
                                                  temperature=1.0, extra_body=EXTRA).choices[0].text

    threads = [threading.Thread(target=ask, args=(seed,)) for seed in (1, 2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for seed in (1, 2, 3):
        assert results[seed] == local_lm.generate("The cat", **{**SETTINGS, "seed": seed}).text


def test_abandoned_stream_stops_and_releases_the_model(client, engine, model_id, caplog):
    caplog.set_level("INFO", logger="swarm.api.engine")
    stream = client.completions.create(model=model_id, prompt="hi", max_tokens=128, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 60
    while engine.pending and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.pending == 0 and "request cancelled" in caplog.text
    assert client.completions.create(model=model_id, prompt="hi", max_tokens=8).choices[0].finish_reason


@pytest.mark.swarm
def test_local_mode_gives_the_same_text(tiny_model_path, local_lm, model_id):
    engine = load_engine(str(tiny_model_path), local=True)
    assert engine.mode == "local" and engine.model_id == model_id
    with serve(create_app(engine)) as url:
        completion = make_client(url).completions.create(model=model_id, prompt="Hello there", max_tokens=16,
                                                         seed=3, temperature=1.0, extra_body=EXTRA)
        assert http(f"{url}/health") == (200, {"model": model_id, "mode": "local", "ok": True, "status": "ok"})
    assert completion.choices[0].text == local_lm.generate("Hello there", **SETTINGS).text


def read_lines(stream: IO[str], lines: list[str]) -> None:
    for line in stream:
        lines.append(line.rstrip())


def get_once_up(url: str, process: subprocess.Popen, timeout: float = 60) -> int:
    """The status of ``url`` once the server in ``process`` listens (it may print before it does)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code
        except urllib.error.URLError:
            assert time.monotonic() < deadline and process.poll() is None, f"{url} never answered"
            time.sleep(0.2)


@pytest.mark.swarm  # a real `python -m swarm.api` process
def test_cli_start_message_names_the_api_the_map_and_the_playground(tiny_model_path):
    """``python -m swarm.api`` prints where each page is, and each URL it prints answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "swarm.api", "--local", "--model", str(tiny_model_path), "--port", str(port),
               "--threads", "1", "--log-level", "WARNING"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=read_lines, args=(process.stderr, lines), daemon=True).start()
    try:
        base = f"http://127.0.0.1:{port}"
        assert get_once_up(f"{base}/v1/models", process) == 200  # printed before it listens: all printed now
        message = [f"Serving model '{default_prefix(tiny_model_path)}' (local) on {base}/v1",
                   f"  swarm map:  {base}/map", f"  playground: {base}/playground"]
        assert wait_until(lambda: message[0] in lines and len(lines) >= lines.index(message[0]) + 3, timeout=5)
        assert lines[lines.index(message[0]):][:3] == message, lines
        assert [get_once_up(f"{base}{path}", process) for path in ("/map", "/playground")] == [200, 200]
    finally:
        process.terminate()
        process.wait(30)


def test_cli_needs_a_swarm_or_local():
    result = CliRunner().invoke(api_main, ["--port", "0"],
                                env={"SWARM_INITIAL_PEERS": None, "SWARM_BOOTSTRAP_FILE": os.devnull})
    assert result.exit_code == 2 and "--local" in result.output


@pytest.mark.parametrize("error, status", [
    (ValueError("bad setting"), 400),
    (MissingBlocksError([2, 3]), 503),
    (EngineBusy("busy"), 503),
    (RuntimeError("boom"), 500),
])
def test_generation_errors_map_to_statuses(error, status):
    assert as_api_error(error).status == status
