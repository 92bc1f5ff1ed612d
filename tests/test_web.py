"""The web pages (docs/WEB.md) in a real headless Chromium, against a real local swarm of the default model.

The swarm map is read through the API's client and through ``python -m swarm.health --serve``; the playground
streams from the API. Set ``SWARM_WEB_SCREENSHOTS=docs`` to save the README's screenshots while the tests run.
"""
from __future__ import annotations

import json
import math
import os
import queue
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

pytest.importorskip("fastapi", reason='the pages are served by FastAPI (pip install -e ".[test]")')
uvicorn = pytest.importorskip("uvicorn", reason='the pages are served by uvicorn (pip install -e ".[test]")')
webdriver = pytest.importorskip("selenium.webdriver",
                                reason='the browser tests need selenium (pip install -e ".[test]")')

from selenium.common.exceptions import StaleElementReferenceException, TimeoutException  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from swarm.adapters.sharing import PublishedAdapter  # noqa: E402
from swarm.adapters.sharing import publish as publish_adapter  # noqa: E402
from swarm.adapters.versions import AdapterVersion, VersionList, store_versions  # noqa: E402
from swarm.api import GenerationEngine, create_app  # noqa: E402
from swarm.dht.node import NetworkConfig  # noqa: E402
from swarm.dht.schema import RECORD_VERSION, ServerRecord, ServerState  # noqa: E402
from swarm.governance.keys import generate_private_key, public_key_text  # noqa: E402
from swarm.governance.records import HALT, RESUME, publish  # noqa: E402
from swarm.health.map import ExpertAnnouncement, audits_of, build_health_map  # noqa: E402
from swarm.reports.records import FAIL, PASS, AdapterAudit, AuditBook, AuditReport, ServerAudit, publish_report  # noqa: E402
from swarm.server.usage import UsageLedger, parse_usage  # noqa: E402
from swarm.utils.local_swarm import LocalSwarm, ManagedProcess  # noqa: E402
from swarm.web.server import listen  # noqa: E402
from swarm.web.snapshot import ClientView, Probe, map_snapshot  # noqa: E402
from swarm.web.watcher import SwarmWatcher, WatchConfig, in_flight_of, own_access  # noqa: E402
from tests.conftest import later_users, wait_seen, wait_until  # noqa: E402
from tests.test_api import serve  # noqa: E402  (uvicorn on a free loopback port, in a thread)

MODEL = "default"  # the embedded model: 16 blocks, readable text for the screenshots
HOSTILE_NAME = "second half <b>as text</b>"  # a server's public name is remote input: never markup
SETTINGS = dict(gen_length=32, steps=8, block_length=16, temperature=0.5, remasking="random", seed=7)  # 4 tokens a step
PROMPT = "The government said"
SCREENSHOTS = os.environ.get("SWARM_WEB_SCREENSHOTS")
WAIT_S = 60


def find_browser() -> tuple[str, str]:
    """Debian's chromium and chromium-driver (never downloaded at run time); skip naming what is missing."""
    binary = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    missing = [name for name, path in (("chromium", binary), ("chromedriver (chromium-driver)", driver)) if not path]
    if missing:
        pytest.skip(f"the browser tests need {' and '.join(missing)}: apt-get install -y chromium chromium-driver")
    return binary, driver


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    binary, driver_path = find_browser()
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1100,900", "--no-first-run", "--disable-extensions"):
        options.add_argument(argument)
    options.binary_location = binary
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def governance_key(tmp_path_factory):
    return generate_private_key(tmp_path_factory.mktemp("governance") / "key")


@pytest.fixture(scope="module")
def web_swarm(tmp_path_factory) -> Iterator[LocalSwarm]:
    """A bootstrap peer and three servers of the default model: 0:8 and two of 8:16. Each has an identity file, so
    a test that stops one starts it again with the same peer id (:func:`stopping_swarm`) for the tests after it."""
    identities = tmp_path_factory.mktemp("identities")
    with LocalSwarm(fork_server=True) as swarm:
        swarm.start_bootstrap()
        servers = [swarm.start_server(MODEL, span, "--compute-threads", "1", "--public-name", name,
                                      "--identity-path", str(identities / f"server{index}.key"), wait=False)
                   for index, (span, name) in enumerate((("0:8", "first half"), ("8:16", HOSTILE_NAME),
                                                         ("8:16", "spare")))]
        for server in servers:
            swarm.wait_ready(server)
        yield swarm


# Tests that need only one of the two 8:16 servers running (they read or stop whichever runs): after a test that
# stopped one, a server's boot and the client's re-read (2-4 CPU s) are spent only for a later test not named here.
COPES_WITH_ONE_REPLICA_STOPPED = ("test_health_serve_map_warns_once_a_server_stops",)


@pytest.fixture
def stopping_swarm(request, web_swarm, web_lm) -> Iterator[LocalSwarm]:
    """``web_swarm`` for a test that stops its servers: afterwards every stopped server starts again with the same
    peer id and flags, and the API's client reads them again (a server it banned for failing comes back at a new
    address, which lifts the ban), so the tests after it find the swarm as the fixtures made it, whatever the order.
    Where no later test of the module needs that (none uses the swarm, or each copes with one replica stopped:
    ``COPES_WITH_ONE_REPLICA_STOPPED``), they are not started again."""
    yield web_swarm
    later = later_users(request, "web_swarm")
    stopped = [server for server in web_swarm.processes if server.span and not server.alive]
    coping = all(item.originalname in COPES_WITH_ONE_REPLICA_STOPPED for item in later) and len(stopped) <= 1
    if not later or coping:
        return
    revived = [web_swarm.restart(server) for server in web_swarm.processes[:] if server.span and not server.alive]
    if revived:
        wait_seen(web_lm, revived)


@pytest.fixture(scope="module")
def web_lm(web_swarm, governance_key):
    from swarm.client import DistributedDiffusionLM

    lm = DistributedDiffusionLM.from_pretrained(MODEL, initial_peers=web_swarm.initial_peers, request_timeout=20,
                                                governance_keys=(public_key_text(governance_key),),
                                                route_refresh=600)  # keeps its route: a stopped hop fails over
    # As operators do when they set up keys: clients trusting them stop when they read no decision for long.
    assert publish(lm.dht, governance_key, MODEL, RESUME, "set-up") is not None
    yield lm
    lm.shutdown()


@pytest.fixture(scope="module")
def local_model():
    from swarm.frontend.local import DiffusionLM

    return DiffusionLM.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def api_url(web_lm) -> Iterator[str]:
    with serve(create_app(GenerationEngine(web_lm, MODEL))) as url:
        yield url


@dataclass(frozen=True)
class Audited:
    """What :func:`audited` published: the auditor's key (base64), the servers it failed and passed, the adapter."""

    auditor: str
    failed: str  # peer id of the 0:8 server
    passed: tuple[str, ...]  # peer ids of both 8:16 servers (a later test stops one, whichever its route used)
    adapter: PublishedAdapter


@pytest.fixture(scope="module")
def audited(web_swarm, web_lm, tmp_path_factory) -> Audited:
    """An auditor (not the governance key web_lm trusts: its client keeps every server) fails the 0:8 server and
    passes both 8:16 ones, and scores a published adapter; a stranger publishes the opposite in its own slot."""
    auditor, stranger = (generate_private_key(tmp_path_factory.mktemp(name) / "key")
                         for name in ("auditor", "stranger"))
    failed = next(p.peer_id for p in web_swarm.processes if p.span == (0, 8))
    passed = tuple(p.peer_id for p in web_swarm.processes if p.span == (8, 16))
    author = Ed25519PrivateKey.generate()
    adapter = publish_adapter(web_lm.dht, author, web_lm.prefix, PublishedAdapter(
        "adder", "ab" * 32, 4096, {"model": MODEL}, score=0.99, published=time.time()))
    now = time.time()
    # its two versions (the record's content is the second): the map draws their curve
    store_versions(web_lm.dht, author, web_lm.prefix, VersionList("adder", (
        AdapterVersion(1, "cd" * 32, 4096, None, "ef" * 32, 0.5, now - 100),
        AdapterVersion(2, "ab" * 32, 4096, "cd" * 32, "ef" * 32, 0.99, now - 50))))

    def report(auditor_key, fail: str, ok: tuple[str, ...]) -> AuditReport:
        entries = (ServerAudit(fail, 0, 8, 2, 1, 0, now - 60, now - 1, FAIL, now - 1, "wrong hidden states", 80.0, 8.0),
                   *(ServerAudit(peer, 8, 16, 3, 0, 0, now - 60, now - 1, PASS, announced=80.0, measured=70.0)
                     for peer in ok))
        scores = (AdapterAudit(adapter.name, adapter.author, adapter.sha256, "addition", 10, 4, now - 1, 0.99),
                  AdapterAudit(adapter.name, adapter.author, "cd" * 32, "addition", 10, 2, now - 1, 0.5))
        return AuditReport(web_lm.prefix, int(now * 1000), now, entries, public_key_text(auditor_key), scores)

    assert publish_report(web_lm.dht, auditor, report(auditor, failed, passed), 600) is not None
    assert publish_report(web_lm.dht, stranger, report(stranger, passed[0], (failed,)), 600) is not None
    return Audited(public_key_text(auditor), failed, passed, adapter)


# ----- browser helpers --------------------------------------------------------------------------------------
def wait_for(driver, condition: Callable[[Any], Any], what: str, timeout: float = WAIT_S) -> Any:
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.5,
                             ignored_exceptions=(StaleElementReferenceException,)).until(condition)
    except TimeoutException:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}; page says: "
                             f"{driver.find_element(By.TAG_NAME, 'main').text[-2000:]}") from None


def text_of(driver, element_id: str) -> str:
    """An element's exact text (``textContent``: no whitespace folding, unlike selenium's ``.text``)."""
    return driver.find_element(By.ID, element_id).get_attribute("textContent")


def console_errors(driver, allowed: tuple[str, ...] = ()) -> list[str]:
    """SEVERE browser log entries since the last call, minus those naming an ``allowed`` status."""
    return [entry["message"] for entry in driver.get_log("browser")
            if entry["level"] == "SEVERE" and not any(status in entry["message"] for status in allowed)]


def screenshot(driver, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(SCREENSHOTS) / name))


def server_rows(driver) -> list[dict[str, str]]:
    """The server table as {column: text} per row, read in one go (the page redraws it every poll)."""
    return driver.execute_script("""
        return Array.from(document.querySelectorAll('#servers tbody tr[id^="server-"]')).map((row) =>
            Object.fromEntries([['id', row.id], ...Array.from(row.cells).map((td) => [td.dataset.label,
                                                                                       td.textContent])]));""")


def bars(driver) -> list[tuple[str, str]]:
    """(aria-label, class) of each server's bar, read in one go."""
    return driver.execute_script("""return Array.from(document.querySelectorAll('.bar')).map((bar) =>
                                        [bar.getAttribute('aria-label'), bar.className]);""")


def map_is_drawn(driver, answering: int, servers: Optional[int] = None) -> bool:
    """``answering`` servers answered this peer's ping, of ``servers`` listed (any number when None)."""
    rows = server_rows(driver)
    return sum(row["Round trip (ms)"] != "—" for row in rows) == answering and len(rows) == (servers or len(rows))


def no_horizontal_scroll(driver) -> bool:
    return driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")


def tab_to(driver, wanted: str, presses: int = 40) -> None:
    """Press Tab from the top of the page until ``wanted`` (JS, about ``document.activeElement``) holds."""
    driver.execute_script("document.activeElement && document.activeElement.blur(); window.scrollTo(0, 0)")
    for _ in range(presses):
        ActionChains(driver).send_keys(Keys.TAB).perform()
        if driver.execute_script(f"return Boolean({wanted})"):
            return
    raise AssertionError(f"{presses} presses of Tab never reached an element where {wanted}")


def open_playground(driver, url: str) -> None:
    driver.get(f"{url}/playground")
    wait_for(driver, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"), "the settings")


def type_settings(driver, settings: dict[str, Any], prompt: str = PROMPT) -> None:
    """Fill the form with the keyboard only; the last field's Enter submits it, as in any form."""
    fields = {"prompt": prompt, **{name: value for name, value in settings.items()}}
    for name, value in fields.items():
        field = driver.find_element(By.ID, name)
        if field.tag_name == "select":
            driver.execute_script("arguments[0].focus()", field)
            field.send_keys(Keys.HOME)  # from the first option: the form may start on any (the model's default)
            for _ in range(8):  # arrow keys walk the options, as a keyboard user would
                if field.get_attribute("value") == value:
                    break
                field.send_keys(Keys.ARROW_DOWN)
            assert field.get_attribute("value") == value
            continue
        type_into(field, value)
    driver.switch_to.active_element.send_keys(Keys.ENTER)


def type_into(field, value: Any) -> None:
    """Replace a field's text as a user would: select all, delete, type (modifiers are released per call)."""
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.DELETE, str(value))


def watch_canvas(driver) -> None:
    """Record (masked, newest) cell counts after every change of the canvas, for :func:`canvas_history`."""
    driver.execute_script("""
        window.canvasHistory = [];
        const canvas = document.getElementById('canvas');
        new MutationObserver(() => window.canvasHistory.push([
            canvas.querySelectorAll('.cell.masked').length, canvas.querySelectorAll('.cell.new').length,
            canvas.querySelectorAll('.cell').length])).observe(canvas, {subtree: true, childList: true,
            attributes: true, characterData: true});""")


def finished(driver) -> str:
    summary = text_of(driver, "summary")
    return summary if summary.startswith(("Done", "Stopped")) else ""


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


# ----- no browser: the map's data and the stream's new fields -----------------------------------------------
def hostile_record(peer: str, **changes) -> ServerRecord:
    """A record with hostile values. The schema refuses most of them (``ServerRecord.from_value``: a NaN
    throughput, names that are not text); the map must stay valid JSON even if one got through, so the record is
    built directly."""
    value = {"record_version": RECORD_VERSION, "state": 2, "start": 0, "end": 2, "throughput": 10.0, **changes}
    fields = dict(value, state=ServerState(value["state"]))
    del fields["record_version"]
    return ServerRecord(peer, **fields)


def test_map_data_is_valid_json_whatever_servers_announce():
    """NaN and infinite numbers, markup, huge strings and wrong types in records never break /map.json."""
    refused = {"record_version": RECORD_VERSION, "state": 2, "start": 0, "end": 2, "throughput": float("nan")}
    assert ServerRecord.from_value("peerA", refused) is None  # the first line of defence; the map is the second
    records = [hostile_record("peerA", throughput=float("nan"),
                              public_name={"not": "a string"}, version="v" * 10_000, experts=[1, None, "code"],
                              adapter_kinds=[None, "bottleneck", "<b>" * 100]),
               hostile_record("peerB", start=2, end=4, throughput=float("inf"),
                              public_name=HOSTILE_NAME, numerics="int8 weights")]
    experts = {"code": [ExpertAnnouncement("code", "peerC", {"garbage": True}),
                        ExpertAnnouncement("code", "peerD", float("nan"))]}
    health = build_health_map(records, "m", 6, experts)
    probes = {"peerA": Probe(rtt_ms=float("nan"), in_flight=2), "peerB": Probe(error="x" * 5000)}
    snapshot = map_snapshot(health, probes, ClientView(banned=frozenset({"peerB"})), {"enabled": False}, "api", True)
    json.dumps(snapshot, allow_nan=False)  # raises on NaN / infinity
    first, second = snapshot["servers"]
    assert first["throughput"] is None and first["public_name"] is None and len(first["version"]) == 40
    assert first["experts"] == ["code"] and first["rtt_ms"] is None and first["status"] == "busy"
    assert first["adapter_kinds"] == ["bottleneck", ("<b>" * 100)[:120]] and second["adapter_kinds"] == []
    assert second["public_name"] == HOSTILE_NAME and second["status"] == "banned" and second["approximate"]
    assert len(second["probe_error"]) == 200 and snapshot["uncovered"] == [[4, 6]]
    assert snapshot["experts"] == [{"domain": "code", "peers": [], "malformed": 2}]


def test_map_data_carries_trusted_audits_usage_and_adapters():
    """A book's reports become each server's ``audit`` (health --json's object, extra fields passed on) and each
    adapter's audited scores beside its claim; the ping's usage counts become the row's totals."""
    now, auditor = time.time(), public_key_text(Ed25519PrivateKey.generate())
    book = AuditBook("m", frozenset({auditor}))
    assert book.consider(AuditReport("m", 1, now, (
        ServerAudit("peerA", 0, 2, 0, 1, 0, now - 60, now - 5, FAIL, now - 5, "wrong logits", 50.0, 5.0),
        ServerAudit("peerB", 2, 4, 3, 0, 0, now - 60, now - 5, PASS, announced=100.0, measured=9.5, calibrated=10.0)),
        auditor,
        (AdapterAudit("adder", auditor, "a" * 64, "addition", 10, 7, now - 5, claimed=0.99),)))
    adapters = [{"name": "adder", "author": "0123456789abcdef", "sha256": "a" * 64, "size": 1000, "score": 0.99,
                 "hosts": ["peerB"]}]
    health = build_health_map([hostile_record("peerA"), hostile_record("peerB", start=2, end=4),
                               hostile_record("peerC", start=4, end=6)], "m", 6)
    health.adapters, health.audits = adapters, audits_of(book, adapters)
    health.audits["peerB"]["future"] = 12.5  # a field this page does not know yet is passed on
    ledger = UsageLedger()
    ledger.record("caller", 64, 0.5, now)
    probes = {"peerA": Probe(rtt_ms=1.0, usage=parse_usage(ledger.info(now))), "peerB": Probe(error="timeout")}
    snapshot = map_snapshot(health, probes, ClientView(), {"enabled": False}, "health", False, [auditor])
    json.dumps(snapshot, allow_nan=False)
    failed, passed, unchecked = snapshot["servers"]
    assert failed["audit"]["verdict"] == FAIL and failed["audit"]["reason"] == "wrong logits" and failed["audit_failed"]
    assert failed["audit"]["auditor"] == auditor and failed["audit"]["measured"] == 5.0
    assert passed["audit"]["future"] == 12.5 and not passed["audit_failed"] and unchecked["audit"] is None
    assert passed["audit_overclaims"] == 10.0 and failed["audit_overclaims"] is None  # announces 10x its calibration
    assert failed["usage"] == {"tokens": 64, "seconds": 0.5, "requests": 1, "refused": 0}
    assert passed["usage"] is None and unchecked["usage"] is None  # no answer; not pinged
    assert snapshot["auditors"] == [auditor]
    assert snapshot["adapters"] == [{"name": "adder", "author": "0123456789abcdef", "sha256": "a" * 64,
                                     "size": 1000, "claimed": 0.99, "hosts": 1,
                                     "audits": {"addition": {"correct": 7, "examples": 10, "score": 0.7,
                                                             "checked": now - 5, "auditor": auditor}},
                                     "versions": []}]


@pytest.mark.parametrize("info, expected", [
    ({"admission": {"span": {"in_flight": 2}, "experts": {"in_flight": 1}}}, 3),
    ({"admission": {"span": {"in_flight": -5}}}, None),
    ({"admission": {"span": {"in_flight": "9"}}}, None),
    ({"admission": {"span": {"in_flight": True}}}, None),
    ({"admission": ["span"]}, None),
    ("not a dict", None),
])
def test_server_load_is_read_defensively(info, expected):
    assert in_flight_of(info) == expected


class SlowWatcher(SwarmWatcher):
    """A watcher whose reads of the swarm last until ``release`` is set: only the waiting policy is under test."""

    def __init__(self, **kwargs):
        super().__init__(access=None, source="api", playground=True, **kwargs)
        self.release, self.reads = threading.Event(), 0

    def _read(self) -> dict[str, Any]:
        self.reads += 1
        assert self.release.wait(10)
        return {"read": self.reads}


def test_a_slow_read_of_the_swarm_holds_no_other_page():
    watcher = SlowWatcher(config=WatchConfig(min_interval=0, read_timeout=30))
    watcher.release.set()
    assert watcher.snapshot() == {"read": 1}
    watcher.release.clear()
    reading = threading.Thread(target=watcher.snapshot)
    reading.start()
    while watcher.reads < 2:
        time.sleep(0.01)
    started = time.monotonic()
    # The previous one, while the read is still held: not after read_timeout (30 s; half of it is a margin no
    # loaded machine needs, where 0.2 s was one it sometimes did).
    assert watcher.snapshot() == {"read": 1} and time.monotonic() - started < 15 and not watcher.release.is_set()
    watcher.release.set()
    reading.join(5)
    first = SlowWatcher(config=WatchConfig(read_timeout=0.3))
    threading.Thread(target=first.snapshot, daemon=True).start()
    while not first.reads:
        time.sleep(0.01)
    with pytest.raises(TimeoutError, match="still being read after 0 s"):
        first.snapshot()  # nothing to show yet: a clear error after read_timeout, not a hang
    first.release.set()


@pytest.mark.swarm
def test_serve_refuses_a_port_in_use_before_joining_any_swarm():
    from click.testing import CliRunner

    from swarm.health.__main__ import main as health_main

    with listen("127.0.0.1", 0) as taken:
        port = str(taken.getsockname()[1])
        result = CliRunner().invoke(health_main, ["--serve", "--port", port, "--dht-prefix", "m", "--num-blocks", "4",
                                                  "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWRVbNXZSAwuv4jbz"
                                                  "q2sMzNsKzEMKruFjT9mKuXxBYHUBc"])
    assert result.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in result.output


@pytest.mark.swarm
def test_a_watcher_shows_its_trusted_auditors_reports_and_each_servers_usage(web_swarm, web_lm, audited, api_url):
    """The auditor's verdicts, not the stranger's, and the adapter's audited score beside its claim; the usage each
    server reports (the client's challenges were calls); a watcher that trusts no auditor shows none."""
    web_lm.generate(PROMPT, gen_length=4, steps=1, block_length=4)  # one pass: every server computes for a caller
    # on the client's DHT peer (a peer of its own is a DHT process and a daemon more; health --serve's own is tested
    # below)
    access = own_access(NetworkConfig(initial_peers=web_swarm.initial_peers, client_mode=True), web_lm.prefix, 16,
                        auditors=[audited.auditor], dht=web_lm.dht)
    try:
        snapshot = SwarmWatcher(access, source="health", playground=False).snapshot()
        untrusting = SwarmWatcher(replace(access, audits=None), source="health", playground=False).snapshot()
    finally:
        access.close()
    servers = {server["peer_id"]: server for server in snapshot["servers"]}
    failed, passed = servers[audited.failed], servers[audited.passed[0]]
    assert failed["audit"]["verdict"] == FAIL and failed["audit_failed"]
    assert failed["audit"]["auditor"] == audited.auditor
    assert failed["audit"]["reason"] == "wrong hidden states" and failed["audit"]["measured"] == 8.0
    assert passed["audit"]["verdict"] == PASS and not passed["audit_failed"]
    assert snapshot["auditors"] == [audited.auditor]
    adapter = next(a for a in snapshot["adapters"] if a["sha256"] == audited.adapter.sha256)
    assert adapter["claimed"] == 0.99 and adapter["audits"]["addition"]["correct"] == 4
    usage = [server["usage"] for server in snapshot["servers"] if server["usage"] is not None]
    assert len(usage) == 3 and sum(counts["requests"] > 0 for counts in usage) >= 2, usage  # the route's two hops
    assert all(server["audit"] is None and not server["audit_failed"] for server in untrusting["servers"])
    assert untrusting["auditors"] == [] and all(not a["audits"] for a in untrusting["adapters"])
    with urllib.request.urlopen(f"{api_url}/map.json", timeout=30) as response:
        api = json.loads(response.read())
    # The API's page reads its client's book: the governance key by default, which has published no report
    assert api["auditors"] == sorted(web_lm.planner.audits.trusted) != [] and audited.auditor not in api["auditors"]
    assert all(server["audit"] is None for server in api["servers"])


def test_stream_chunks_carry_the_canvas(local_model):
    """Per step: each position's text or None, the positions just filled, and the tokens decode to the answer."""
    chunks = list(local_model.generate_stream(PROMPT, **SETTINGS))
    steps, result = chunks[:-1], chunks[-1].result
    assert len(steps) == SETTINGS["steps"] and all(len(c.tokens) == SETTINGS["gen_length"] for c in steps)
    previous = [None] * SETTINGS["gen_length"]
    for chunk in steps:
        assert chunk.unmasked and all(previous[i] is None and chunk.tokens[i] is not None for i in chunk.unmasked)
        assert sum(token is None for token in chunk.tokens) == chunk.masked_left
        assert chunk.route == [] and chunk.failovers == []  # one process: no route
        previous = chunk.tokens
    final_state = result.sequence[len(result.prompt_ids):].tolist()
    assert previous == [local_model.tokenizer.decode([token]) for token in final_state]


# ----- in the browser ---------------------------------------------------------------------------------------
def test_map_shows_every_server_read_through_the_api(browser, api_url):
    browser.get(f"{api_url}/map?every=1")
    wait_for(browser, lambda d: map_is_drawn(d, 3, servers=3), "every server, pinged")
    assert text_of(browser, "coverage").startswith("Every block is served: 16 blocks")
    # web_lm's set-up resume (its fixture comes before api_url's), or a halt test's resume once the map reads it
    wait_for(browser, lambda d: text_of(d, "governance").startswith("Running"), "the governance state: running")
    rows = server_rows(browser)
    assert all(int(row["Cache room (tokens)"]) > 0 for row in rows), rows  # each server's free cache, announced
    names = [row["Name"] for row in rows]
    assert names[0] == "first half" and sorted(names[1:]) == sorted([HOSTILE_NAME, "spare"])  # markup as text
    assert not browser.find_elements(By.CSS_SELECTOR, "main b")
    assert [label.split(":")[0] for label, _ in bars(browser)] == names
    assert all("status-online" in classes for _, classes in bars(browser)), bars(browser)
    assert browser.find_element(By.ID, "nav-playground").is_displayed()
    screenshot(browser, "web-map.png")
    tab_to(browser, "document.activeElement.classList.contains('bar')")
    focused = browser.execute_script("return document.activeElement.dataset.key")
    browser.execute_async_script("refresh().then(arguments[0])")  # a redraw replaces the bars, now, not by the clock
    assert browser.execute_script("return document.activeElement.dataset.key") == focused  # the focus stays on it
    ActionChains(browser).send_keys(Keys.ENTER).perform()  # a bar leads to its server's row, without a mouse
    assert browser.execute_script("return location.hash") == f"#{server_rows(browser)[0]['id']}"
    browser.set_window_size(380, 800)  # a phone: the table becomes cards, nothing scrolls sideways
    try:
        assert wait_for(browser, no_horizontal_scroll, "a narrow layout")
    finally:
        browser.set_window_size(1100, 900)
    assert console_errors(browser) == []


def test_playground_text_equals_the_api_and_the_local_model(browser, api_url, local_model):
    open_playground(browser, api_url)
    fields = browser.find_elements(By.CSS_SELECTOR, "input, select, textarea")
    assert fields and all(browser.execute_script("return arguments[0].labels.length", f) == 1 for f in fields)
    watch_canvas(browser)
    type_settings(browser, SETTINGS)  # keyboard only: typed, then Enter
    summary = wait_for(browser, finished, "the generation to end")
    assert summary.startswith("Done"), text_of(browser, "error")
    status, api = post(f"{api_url}/v1/completions", {"model": MODEL, "prompt": PROMPT, "stream": False, **SETTINGS})
    assert status == 200, api
    expected = local_model.generate(PROMPT, **SETTINGS).text
    assert text_of(browser, "final-text") == api["choices"][0]["text"] == expected
    history = browser.execute_script("return window.canvasHistory")
    masked = [entry[0] for entry in history if entry[2]]
    assert masked[0] > 0 and masked[-1] == 0 and masked == sorted(masked, reverse=True)  # masks fill in
    assert any(entry[1] for entry in history)  # the newest cells were highlighted
    assert history[-1][2] == SETTINGS["gen_length"]  # one cell per generated position
    assert text_of(browser, "step") == str(SETTINGS["steps"])
    assert "[0:8]" in text_of(browser, "route") and "[8:16]" in text_of(browser, "route")
    assert not math.isnan(float(text_of(browser, "rate")))
    tab_to(browser, "document.activeElement.id === 'generate' && !document.activeElement.disabled")
    browser.set_window_size(380, 800)
    try:
        assert wait_for(browser, no_horizontal_scroll, "a narrow layout")
    finally:
        browser.set_window_size(1100, 900)
    if SCREENSHOTS:
        capture_mid_generation(browser)
    assert console_errors(browser) == []


def capture_mid_generation(driver) -> None:
    """The README's screenshot: a longer answer caught while about half of it is still masked."""
    driver.set_window_size(1000, 1250)
    try:
        for name, value in (("gen_length", 96), ("steps", 96), ("block_length", 32)):
            type_into(driver.find_element(By.ID, name), value)
        driver.find_element(By.ID, "generate").send_keys(Keys.ENTER)
        wait_for(driver, lambda d: 35 <= len(d.find_elements(By.CSS_SELECTOR, "#canvas .cell.masked")) <= 50,
                 "a half-filled canvas")
        screenshot(driver, "web-playground.png")
        wait_for(driver, finished, "the generation to end")
    finally:
        driver.set_window_size(1100, 900)


def test_playground_shows_bad_settings_and_a_halt(browser, api_url, web_lm, governance_key):
    open_playground(browser, api_url)
    type_settings(browser, {**SETTINGS, "block_length": 5})
    wait_for(browser, lambda d: d.find_element(By.ID, "error").is_displayed(), "the API's message")
    assert "divisible by block_length" in text_of(browser, "error") and "HTTP 400" in text_of(browser, "error")
    type_settings(browser, {**SETTINGS, "experts": "code:lots"})  # caught before any request
    wait_for(browser, lambda d: "is not name:weight" in text_of(d, "error"), "the form's own message")
    assert text_of(browser, "error").startswith('experts: "code:lots" is not name:weight')
    assert publish(web_lm.dht, governance_key, MODEL, HALT, "maintenance window") is not None
    try:
        open_playground(browser, api_url)
        type_settings(browser, SETTINGS)
        wait_for(browser, lambda d: d.find_element(By.ID, "error").is_displayed(), "the halt message")
        assert "halted" in text_of(browser, "error").lower() and "maintenance window" in text_of(browser, "error")
        assert text_of(browser, "final-text") == ""
        browser.get(f"{api_url}/map?every=1")
        wait_for(browser, lambda d: "HALTED" in text_of(d, "governance"), "the halt on the map")
        governance = text_of(browser, "governance")
        assert "maintenance window" in governance and "ago)" in governance
    finally:
        publish(web_lm.dht, governance_key, MODEL, RESUME, "done", trusted=[governance_key.public_key()])
        # the resume read back before the next test, whichever it is: by the client and on the API's map
        assert wait_until(lambda: getattr(web_lm.guard.current(force=True), "halted", None) is False, timeout=WAIT_S)
        browser.get(f"{api_url}/map?every=1")
        wait_for(browser, lambda d: text_of(d, "governance").startswith("Running"), "the resume on the map")
    assert console_errors(browser, allowed=("status of 400", "status of 503")) == []


def test_playground_shows_a_failover(browser, api_url, stopping_swarm, web_lm, local_model):
    """The server of the route's second hop stops: the answer is the same, and the page names the failover."""
    web_lm.planner.refresh()  # the servers as they are now (an earlier test may have stopped and restarted some)
    hop = next(hop for hop in web_lm.planner.build_route() if hop.start == 8)  # kept for the next generation
    stopping_swarm.terminate(next(p for p in stopping_swarm.processes if p.peer_id == hop.peer_id))
    open_playground(browser, api_url)
    type_settings(browser, SETTINGS)
    assert wait_for(browser, finished, "the generation to end").startswith("Done"), text_of(browser, "error")
    assert text_of(browser, "final-text") == local_model.generate(PROMPT, **SETTINGS).text
    failovers = text_of(browser, "failovers")
    assert f"block 8: …{hop.peer_id[-8:]} failed" in failovers and "another server took over" in failovers
    assert hop.peer_id not in text_of(browser, "route") and "[8:16]" in text_of(browser, "route")
    assert console_errors(browser) == []


def test_health_serve_map_warns_once_a_server_stops(browser, stopping_swarm, api_url, governance_key, audited):
    command = ["-m", "swarm.health", "--serve", "--port", "0", "--model", MODEL, "--trusted-auditors", audited.auditor,
               *[arg for peer in stopping_swarm.initial_peers for arg in ("--initial-peers", peer)]]
    # forked from the swarm's fork server, which has imported torch and hivemind (exec'd: 2-2.5 CPU s more)
    process = stopping_swarm.start_command("health --serve", command,
                                           env={"SWARM_GOVERNANCE_KEYS": public_key_text(governance_key)})
    try:
        url = read_ready_url(process)
        browser.get(f"{url}?every=1")
        # every server runs (a test that stopped one started it again under its peer id: stopping_swarm)
        running = sum(1 for p in stopping_swarm.processes if p.alive and p.span)
        wait_for(browser, lambda d: map_is_drawn(d, running), "the running servers on the operator's map")
        assert not browser.find_element(By.ID, "nav-playground").is_displayed()  # no API here
        assert "Running" in text_of(browser, "governance")  # watched: the keys came from the environment
        audits = {row["id"]: row["Audit"] for row in server_rows(browser)}
        assert audits[f"server-{audited.failed}"].startswith("FAIL 2/3 at ")  # passed of all checks, as swarm.health
        assert "measured 8 of 80 tok/s" in audits[f"server-{audited.failed}"]
        # both 8:16 servers the auditor passed, each shown once the map has read it
        shown = [audits[f"server-{peer}"] for peer in audited.passed if f"server-{peer}" in audits]
        assert shown and all(audit.startswith("pass 3/3 at ") for audit in shown), audits
        marked = [label for label, classes in bars(browser) if "audit-failed" in classes]
        assert len(marked) == 1 and "failed its last audit" in marked[0]
        assert "addition 4/10 (40%)" in browser.find_element(By.ID, "adapters").text
        # the versions' curve: own figures (dashed) and audited scores, one point per version, the newest named
        assert "v2" in browser.find_element(By.CSS_SELECTOR, "#adapters .version-curve").text
        assert browser.execute_script("return document.querySelectorAll('#adapters .version-curve polyline')"
                                      ".length") == 2
        screenshot(browser, "web-map-audits.png")
        stopping = [p for p in stopping_swarm.processes if p.span == (8, 16) and p.alive]  # both
        with ThreadPoolExecutor(len(stopping)) as pool:  # each announces OFFLINE as it leaves (1-3 s): at once
            list(pool.map(stopping_swarm.terminate, stopping))
        wait_for(browser, lambda d: text_of(d, "coverage").startswith("Uncovered blocks 8:16"), "the warning")
        assert browser.execute_script("return document.querySelectorAll('.replicas.uncovered').length") == 8
        statuses = {row["Status"] for row in server_rows(browser) if row["Blocks"] == "8:16"}
        assert statuses == {"offline"}
        assert console_errors(browser) == []
        browser.get("about:blank")  # stop polling before the map's server goes away
    finally:
        code = stopping_swarm.terminate(process, signal.SIGTERM, timeout=30)
    assert code == 0, f"--serve did not stop cleanly on SIGTERM (exit code {code}):\n" + "\n".join(process.log[-20:])
    open_playground(browser, api_url)  # and the playground says which blocks are missing
    type_settings(browser, SETTINGS)
    wait_for(browser, lambda d: d.find_element(By.ID, "error").is_displayed(), "the missing-blocks message")
    assert "HTTP 503" in text_of(browser, "error") and "blocks 8:16" in text_of(browser, "error")
    assert console_errors(browser, allowed=("status of 503",)) == []


def read_ready_url(process: ManagedProcess) -> str:
    """The URL ``--serve`` prints once it listens (``MAP READY <url>``)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and process.alive:
        try:
            line = process.lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line.startswith("MAP READY "):
            return line.split()[-1]
    raise AssertionError("python -m swarm.health --serve did not start:\n" + "\n".join(process.log[-30:]))
