"""The workstation UI as a person uses it: real headless Chromium (Debian's) driven by Playwright.

The suite starts the real server the way ``make run`` does (``app.py serve --model <default model>``, on a free
port) and drives the page: a chat reply streams in token by token; the dashboard's numbers move while a reply
streams in another tab; bad input gets readable messages; a Hub repo is added and downloaded (from a local fake
Hub); the AWQ build of the default model is loaded from the Models tab while a reply streams (that reply is
cut off with a readable message) and then answers a new message; the Server tab shows a working endpoint.
Finally the server's stderr must hold no traceback. Last, a second server started with ``--api-key`` shows its
login page instead of the UI, refuses a wrong key, and after the right one serves the UI until logout. Screenshots of each tab go to test-artifacts/ui/.

Long replies use temperature 2.0: the sampled tokens are then close to uniform, so the end-of-sequence token
(1 of 49,152) practically never ends a reply early and its length is set by max tokens, which keeps timings
predictable on a slow CPU.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fake_hub import FakeHub
from server_process import free_port, serving

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts" / "ui"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
AWQ_ID = "smollm2-135m-instruct-awq"
API_KEY = "browser-key-123"
FAKE_REPO = "pagoda-test/smollm2-copy"

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)")


# ---- fixtures: the AWQ build, a fake Hub, the server, the browser -------------------------------------------
@pytest.fixture(scope="module")
def awq_model() -> Path:
    """The catalog's AWQ build of the default model (made by Pagoda's quantizer, as `app.py fetch` does)."""
    from engine.catalog import Catalog, fetch

    catalog = Catalog.load()
    return fetch(catalog.get(AWQ_ID), catalog, log=lambda msg: None)


@pytest.fixture(scope="module")
def fake_hub(default_model_dir) -> Iterator[FakeHub]:
    """A local Hub with one downloadable repo (the default model's configs and tokenizer, 6 MB of weights)."""
    files = {name: (default_model_dir / name).read_bytes()
             for name in ("config.json", "tokenizer.json", "tokenizer_config.json")}
    files["model.safetensors"] = os.urandom(6 << 20)  # the download does not parse the weights
    with FakeHub() as hub:
        hub.add_repo(FAKE_REPO, files)
        yield hub


@pytest.fixture(scope="module")
def server(default_model_dir, fake_hub, tmp_path_factory) -> Iterator[dict]:
    """``app.py serve --model <default model> --port <free>``; its own Pagoda home (models shared), HF cache
    and Hub endpoint (the fake one). Yields the URL, port and the stderr log path."""
    from engine.bundled import models_dir

    home = tmp_path_factory.mktemp("pagoda-home")
    (home / "models").symlink_to(models_dir(), target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PAGODA_API_KEY", "HF_HUB_OFFLINE", "HF_TOKEN")}
    env.update(PAGODA_HOME=str(home), HF_ENDPOINT=fake_hub.endpoint, HF_HUB_CACHE=str(home / "hf-cache"),
               HF_HOME=str(home / "hf-home"))
    port = free_port()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    err_path, out_path = ARTIFACTS / "server.stderr.log", ARTIFACTS / "server.stdout.log"
    cmd = [sys.executable, str(ROOT / "app.py"), "serve", "--model", str(default_model_dir), "--port", str(port)]
    with open(err_path, "wb") as err, open(out_path, "wb") as out, \
            serving(cmd, env, out, err, err_path.read_text) as url:
        yield {"url": url, "port": port, "stderr": err_path}


@pytest.fixture(scope="module")
def keyed_server(default_model_dir, tmp_path_factory) -> Iterator[dict]:
    """The same server with ``--api-key`` (its own Pagoda home, models shared; no Hub)."""
    from engine.bundled import models_dir

    home = tmp_path_factory.mktemp("pagoda-home-keyed")
    (home / "models").symlink_to(models_dir(), target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PAGODA_API_KEY", "HF_TOKEN")}
    env.update(PAGODA_HOME=str(home), HF_HUB_CACHE=str(home / "hf-cache"), HF_HUB_OFFLINE="1")
    port = free_port()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    err_path, out_path = ARTIFACTS / "keyed-server.stderr.log", ARTIFACTS / "keyed-server.stdout.log"
    cmd = [sys.executable, str(ROOT / "app.py"), "serve", "--model", str(default_model_dir), "--port", str(port),
           "--api-key", API_KEY]
    with open(err_path, "wb") as err, open(out_path, "wb") as out, \
            serving(cmd, env, out, err, err_path.read_text) as url:
        yield {"url": url, "port": port, "stderr": err_path}


@pytest.fixture(scope="module")
def browser(server, tmp_path_factory):
    """One Chromium profile; it closes before the server stops (no open streams at shutdown)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(60_000)
        yield context
        context.close()


def open_app(browser, server):
    page = browser.new_page()
    page.goto(server["url"] + "/")
    page.wait_for_selector("#chat-input textarea")
    return page


@pytest.fixture(scope="module")
def page(browser, server):
    return open_app(browser, server)


@pytest.fixture(scope="module")
def other_page(browser, server):
    """A second browser tab: its own Gradio session on the same server."""
    return open_app(browser, server)


# ---- page helpers --------------------------------------------------------------------------------------------
BOT_TEXT_JS = """() => {
  const msgs = document.querySelectorAll('#chatbot [data-testid="bot"] .message-content');
  if (!msgs.length) return null;
  const last = msgs[msgs.length - 1].cloneNode(true);
  const stats = last.querySelector('.reply-stats');
  const tokens = stats ? parseInt(stats.textContent.replace(/,/g, '')) : null;
  last.querySelectorAll('.reply-stats').forEach(e => e.remove());
  return {text: last.textContent.trim(), tokens: Number.isNaN(tokens) ? null : tokens};
}"""
LAST_BOT_HAS_TOKENS = """() => { const m = document.querySelectorAll('#chatbot [data-testid="bot"]');
                                 return m.length && m[m.length - 1].innerText.includes('tok/s'); }"""
DONE = re.compile(r"finished|hit max tokens|stopped")


def go_to(page, tab: str) -> None:
    page.get_by_role("tab", name=tab).click()


def set_number(page, elem_id: str, value) -> None:
    """Type into a slider's number box (or a textbox) and commit it."""
    box = page.locator(f"#{elem_id} input[data-testid='number-input'], #{elem_id} textarea, #{elem_id} input").first
    box.fill(str(value))
    box.press("Tab")


def send(page, text: str, with_enter: bool = False) -> None:
    """Send a message and wait until its reply has started (the stats line no longer shows the last end)."""
    box = page.locator("#chat-input textarea")
    box.fill(text)
    if with_enter:
        box.press("Enter")
    else:
        page.locator("#chat-send").click()
    page.wait_for_function("""() => !/finished|hit max tokens|stopped/.test(
        document.querySelector('#reply-stats').innerText) || document.querySelector('#chat-error')?.offsetParent""")


def clear_chat(page) -> None:
    page.locator("#chat-clear").click()
    page.wait_for_function("""() => !document.querySelector('#chatbot [data-testid="bot"]')
                                 && !document.querySelector('#chat-error')?.offsetParent""")


def stream_observations(page, timeout: float = 90.0) -> list[dict]:
    """Poll the last bot message until its stats line says it ended; every distinct state seen."""
    seen: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = page.evaluate(BOT_TEXT_JS)
        if state and (not seen or state != seen[-1]):
            seen.append(state)
        if DONE.search(page.locator("#reply-stats").inner_text()) or page.locator("#chat-error").is_visible():
            break
        time.sleep(0.03)
    final = page.evaluate(BOT_TEXT_JS)
    if final and final != seen[-1]:
        seen.append(final)
    return seen


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def assert_no_traceback_on(page) -> None:
    body = page.locator("body").inner_text()
    assert "Traceback" not in body and "Exception" not in body


# ---- the tests (in order: they share one server and browser) -------------------------------------------------
def test_chat_reply_streams_in_token_by_token(page):
    set_number(page, "max-tokens", 48)
    set_number(page, "temperature", 0)
    send(page, "Give me three short tips for writing clear code.")
    seen = stream_observations(page)
    final = seen[-1]
    assert final["text"], "the reply is empty"
    partial = [s for s in seen[:-1] if s["text"]]
    assert len(partial) >= 3, f"expected several partial renderings before the end, saw {len(partial)}"
    assert all(len(s["text"]) < len(final["text"]) for s in partial[:3])
    counts = [s["tokens"] for s in seen if s["tokens"] is not None]
    assert len(set(counts)) >= 3 and counts == sorted(counts), f"token counts did not grow one by one: {counts}"
    assert "tok/s" in page.locator("#reply-stats").inner_text()
    screenshot(page, "chat")


def test_dashboard_numbers_move_while_a_reply_streams(page, other_page):
    go_to(other_page, "Dashboard")
    other_page.wait_for_selector("#stat-gen-total")
    before = other_page.locator("#stat-gen-total").inner_text()
    set_number(page, "max-tokens", 160)
    set_number(page, "temperature", 2)
    send(page, "Tell me a long story about a lighthouse keeper.")
    totals, running, kv_used, rows, shot = [], set(), set(), 0, False
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        totals.append(other_page.locator("#stat-gen-total").inner_text())
        running.add(other_page.locator("#stat-running").inner_text())
        kv_used.add(other_page.locator("#stat-kv-used").inner_text())
        rows = max(rows, other_page.locator("#dash-requests tbody tr").count())
        if not shot and "1" in running and len(set(totals)) >= 2:
            screenshot(other_page, "dashboard")
            shot = True
        if DONE.search(page.locator("#reply-stats").inner_text()):
            break
        time.sleep(0.25)
    distinct = list(dict.fromkeys([before, *totals]))
    assert len(distinct) >= 3, f"the generated-token counter did not move during the reply: {distinct}"
    as_ints = [int(v.replace(",", "")) for v in distinct]
    assert as_ints == sorted(as_ints)
    assert "1" in running, f"the running count never showed the streaming request: {running}"
    assert len(kv_used) >= 2, f"KV blocks in use did not change: {kv_used}"
    assert rows >= 1, "the request table never listed the streaming request"
    memory = other_page.locator("#dash-memory").inner_text()
    assert "Weights" in memory and "KV cache in use" in memory
    assert shot


def test_two_browser_tabs_chat_at_once_in_one_batch(page, other_page, server):
    go_to(other_page, "Chat")
    for tab in (page, other_page):
        set_number(tab, "max-tokens", 80)
        set_number(tab, "temperature", 2)
    send(page, "Tell me about rivers.")
    send(other_page, "Tell me about mountains.", with_enter=True)
    most = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and most < 2:
        metrics = httpx.get(f"{server['url']}/metrics", timeout=10).text
        found = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", metrics, re.MULTILINE)
        most = max(most, int(float(found.group(1))) if found else 0)
        time.sleep(0.1)
    assert most == 2, "the two tabs' replies never ran in the same batch"
    for tab in (page, other_page):
        assert stream_observations(tab)[-1]["text"]


def test_bad_inputs_show_readable_messages(page):
    go_to(page, "Chat")
    page.locator("#chat-input textarea").fill("")
    page.locator("#chat-send").click()
    error = page.locator("#chat-error")
    error.wait_for(state="visible")
    assert "message is empty" in error.inner_text()
    set_number(page, "seed", "not-a-number")
    send(page, "Hello")
    page.wait_for_function("document.querySelector('#chat-error').innerText.includes('seed')")
    screenshot(page, "chat-bad-input")
    set_number(page, "seed", "")

    go_to(page, "Models")
    result = page.locator("#model-result")
    page.locator("#model-load").click()
    page.wait_for_function("document.querySelector('#model-result').innerText.includes('Select a model')")
    page.locator("#add-model").get_by_text("Add a model from the Hub").click()
    page.locator("#add-ref textarea, #add-ref input").first.fill("this is not a repo id!")
    page.locator("#add-model-btn").click()
    page.wait_for_function("document.querySelector('#model-result').innerText.includes('is not a Hub repo id')")
    page.locator("#add-ref textarea, #add-ref input").first.fill("no-such-org/no-such-model")
    page.locator("#add-model-btn").click()
    page.wait_for_function("document.querySelector('#model-result').innerText.includes('was not found')")
    assert "no-such-org/no-such-model" in result.inner_text()
    assert_no_traceback_on(page)


def test_stop_regenerate_and_edit_the_last_message(page, server):
    go_to(page, "Chat")
    clear_chat(page)
    set_number(page, "max-tokens", 600)
    set_number(page, "temperature", 2)
    send(page, "Describe the ocean in detail.")
    page.wait_for_function(LAST_BOT_HAS_TOKENS)
    page.locator("#chat-stop").click()
    page.wait_for_function("document.querySelector('#reply-stats').innerText.includes('Stopped')")
    stopped = page.evaluate(BOT_TEXT_JS)
    time.sleep(1.0)
    assert page.evaluate(BOT_TEXT_JS) == stopped, "tokens kept arriving after Stop"
    assert "stopped" in page.locator("#chatbot [data-testid='bot']").last.inner_text()
    metrics = httpx.get(f"{server['url']}/metrics", timeout=10).text
    assert re.search(r"^vllm:num_requests_running\{[^}]*\} 0(\.0)?$", metrics, re.MULTILINE), "the stopped request still runs"

    set_number(page, "max-tokens", 12)
    set_number(page, "temperature", 0)
    page.locator("#chat-regenerate").click()
    page.wait_for_function("!document.querySelector('#reply-stats').innerText.includes('Stopped')")
    seen = stream_observations(page)
    assert seen[-1]["text"] and seen[-1]["tokens"] <= 12
    assert page.locator("#chatbot [data-testid='bot']").count() == 1
    assert page.locator("#chatbot [data-testid='user']").count() == 1

    page.locator("#chat-edit").click()
    page.wait_for_function("document.querySelector('#chat-input textarea').value === 'Describe the ocean in detail.'")
    assert page.locator("#chatbot [data-testid='user']").count() == 0


def test_add_a_hub_repo_and_download_it_with_progress(page):
    go_to(page, "Models")
    page.locator("#add-ref textarea, #add-ref input").first.fill(FAKE_REPO)
    page.locator("#add-model-btn").click()
    page.wait_for_function("document.querySelector('#model-result').innerText.includes('Added')")
    details = page.locator("#model-details")  # the new model is selected: its details show
    assert FAKE_REPO in details.inner_text() and "not on this machine yet" in details.inner_text()
    page.locator("#model-download").click()
    page.wait_for_function("document.querySelector('#model-result').innerText.includes('is on this machine')")
    progress = page.locator("#model-progress").inner_text()
    assert "100%" in progress and "done" in progress
    page.wait_for_function("document.querySelector('#model-details').innerText.includes('on disk')")


def test_switch_to_awq_while_streaming_then_chat_again(page, other_page, awq_model):
    go_to(page, "Chat")
    set_number(page, "max-tokens", 1500)
    set_number(page, "temperature", 2)
    send(page, "Write a very long essay about the history of the printing press.")
    page.wait_for_function(LAST_BOT_HAS_TOKENS)
    go_to(other_page, "Models")
    other_page.locator("#models-table").get_by_text(AWQ_ID, exact=True).click()
    other_page.wait_for_function("document.querySelector('#model-details').innerText.includes('AWQ')")
    other_page.locator("#model-load").click()
    other_page.wait_for_function(
        f"document.querySelector('#model-result').innerText.includes('Now serving {AWQ_ID}')", timeout=180_000)
    assert "request(s) in flight" in other_page.locator("#model-result").inner_text()
    screenshot(other_page, "models")
    error = page.locator("#chat-error")
    error.wait_for(state="visible")
    assert "switched" in error.inner_text() and "cut off" in error.inner_text()
    assert_no_traceback_on(page)

    clear_chat(page)
    set_number(page, "max-tokens", 32)
    set_number(page, "temperature", 0)
    send(page, "What is the capital of France?")
    seen = stream_observations(page)
    assert seen and seen[-1]["text"], "the AWQ model gave no reply"
    assert len([s for s in seen[:-1] if s["text"]]) >= 2, "the AWQ reply did not stream"
    assert AWQ_ID in page.locator("#model-status").inner_text()
    assert not page.locator("#chat-error").is_visible()


def test_server_tab_shows_endpoint_snippets_and_command_line(page, server):
    go_to(page, "Server")
    api = f"http://127.0.0.1:{server['port']}/v1"
    page.wait_for_function(f"document.querySelector('#endpoint-url').innerText.includes('{api}')")
    assert "not required" in page.locator("#server-endpoint").inner_text()
    assert api in page.locator("#snippet-python").inner_text()
    assert f"{api}/chat/completions" in page.locator("#snippet-curl").inner_text()
    # the command line names whichever model serves now: the AWQ one by its catalog id after the switch test,
    # the default model by its folder (whose name is its id) when this test runs alone
    models = httpx.get(f"{api}/models", timeout=10).json()  # the snippet's endpoint really answers
    serving = models["data"][0]["id"]
    # the tab shows the command it was built with until the refresh its selection starts arrives: wait for the
    # serving model, not for any --model (the stale command has one too)
    page.wait_for_function("""(serving) => { const command = document.querySelector('#server-command').innerText;
                                             return command.includes('--model ' + serving)
                                                 || (command + ' ').includes('/' + serving + ' '); }""",
                           arg=serving)
    command = page.locator("#server-command").inner_text()
    assert f"--model {serving}" in command or f"/{serving} " in command + " ", (serving, command)
    assert f"--port {server['port']}" in page.locator("#server-command").inner_text()
    screenshot(page, "server")


def test_server_log_has_no_uncaught_exception(server):
    log = server["stderr"].read_text(errors="replace")
    assert "Traceback" not in log, log[log.find("Traceback") - 500:][:4000]


def test_with_a_key_the_ui_asks_for_it_on_a_login_page(browser, keyed_server):
    url = keyed_server["url"]
    page = browser.new_page()
    page.goto(url + "/")
    page.wait_for_selector("#login-form")
    assert "/login" in page.url and not page.locator("#chat-input").count()
    screenshot(page, "login")
    page.locator("#key").fill("not-the-key")
    page.locator("#login-submit").click()
    page.wait_for_selector("#login-form .error")
    assert "not this server's API key" in page.locator("#login-form").inner_text()
    page.locator("#key").fill(API_KEY)
    page.locator("#login-submit").click()
    page.wait_for_selector("#chat-input textarea")  # the whole UI works on the session: chat streams
    set_number(page, "max-tokens", 8)
    set_number(page, "temperature", 0)
    send(page, "Hello!")
    assert stream_observations(page)[-1]["text"]
    go_to(page, "Server")
    page.wait_for_function("document.querySelector('#server-endpoint').innerText.includes('required')")
    page.locator("#logout").click()
    page.wait_for_selector("#login-form")
    page.goto(url + "/")
    page.wait_for_selector("#login-form")  # logged out: the UI is gone again
    page.close()
    log = keyed_server["stderr"].read_text(errors="replace")
    assert "Traceback" not in log, log[log.find("Traceback") - 500:][:4000]
