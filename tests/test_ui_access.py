"""The API key guards the whole server, the Gradio UI and its API included (a real `app.py serve`, no mocks).

With ``--api-key`` nothing but /health and the login page answers without the key: not the page, not Gradio's
config/info/file/queue routes, not a function called by name (``/gradio_api/call/add_model`` with a local folder
has no effect), not /docs or /metrics. With the key the same calls work: as ``Authorization: Bearer`` (plain
HTTP and gradio_client), or through the login page's session cookie. Without a key on loopback nothing asks for
one. The browser side of the login page is in test_ui_browser.py.
"""

from __future__ import annotations

import ast
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_process import launch_server

ROOT = Path(__file__).resolve().parent.parent
KEY = "ui-key-4711"
BEARER = {"Authorization": f"Bearer {KEY}"}
HTML = {"Accept": "text/html,application/xhtml+xml"}
GUARDED_GETS = ["/", "/?view=api", "/config", "/gradio_api/info", "/gradio_api/openapi.json", "/gradio_api/config",
                "/gradio_api/file=/etc/passwd", "/gradio_api/heartbeat/some-session", "/gradio_api/startup-events",
                "/gradio_api/queue/data?session_hash=some-session", "/gradio_api/upload_progress?upload_id=x",
                "/theme.css", "/assets/index.js", "/monitoring", "/docs", "/redoc", "/openapi.json", "/metrics",
                "/version", "/v1/models"]
GUARDED_POSTS = ["/gradio_api/call/load_model", "/gradio_api/call/add_model", "/gradio_api/call/respond",
                 "/gradio_api/call/v2/respond", "/gradio_api/run/respond", "/gradio_api/queue/join",
                 "/gradio_api/upload", "/gradio_api/cancel", "/gradio_api/reset", "/v1/chat/completions"]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """The servers' own Pagoda home (models shared) and HF cache, so ui-models.json shows what a call did."""
    from engine.bundled import models_dir

    home = tmp_path_factory.mktemp("pagoda-home")
    (home / "models").symlink_to(models_dir(), target_is_directory=True)
    return home


def server_env(home: Path) -> dict[str, str]:
    return {"PAGODA_HOME": str(home), "HF_HUB_CACHE": str(home / "hf-cache"), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def keyed(default_model_dir, home) -> Iterator[str]:
    with launch_server(default_model_dir, "--api-key", KEY, "--kv-cache-memory", "64MiB",
                       env=server_env(home)) as url:
        yield url


@pytest.fixture(scope="module")
def keyless(default_model_dir, tmp_path_factory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("pagoda-home-open")
    with launch_server(default_model_dir, "--kv-cache-memory", "64MiB", env=server_env(home)) as url:
        yield url


def call(http: httpx.Client, fn: str, data: list, **kwargs) -> tuple[str, object]:
    """POST /gradio_api/call/<fn>, then read its event stream: (last event name, its data)."""
    r = http.post(f"/gradio_api/call/{fn}", json={"data": data}, **kwargs)
    assert r.status_code == 200, r.text
    with http.stream("GET", f"/gradio_api/call/{fn}/{r.json()['event_id']}", timeout=120, **kwargs) as stream:
        lines = stream.read().decode().splitlines()
    events = [(e.removeprefix("event: "), d.removeprefix("data: ")) for e, d in itertools.pairwise(lines)
              if e.startswith("event: ") and d.startswith("data: ")]
    event, payload = events[-1]
    return event, json.loads(payload)


def hub_model() -> str:
    """A catalog model from the Hub: never downloaded in the servers' empty HF cache."""
    from engine.catalog import Catalog

    return next(entry.id for entry in Catalog.load() if entry.source == "hub")


def assert_refused(r: httpx.Response) -> None:
    assert r.status_code == 401, (r.request.url, r.status_code, r.text[:300])
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert "gradio" not in r.text.lower() and "load_model" not in r.text


# ---- with --api-key: refused without it ---------------------------------------------------------------------
def test_only_health_and_the_login_page_answer_without_the_key(keyed, home, default_model_dir):
    with httpx.Client(base_url=keyed, timeout=30) as http:
        assert http.get("/health").status_code == 200
        login = http.get("/login")
        assert login.status_code == 200 and 'name="key"' in login.text
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"X-API-Key": "wrong-key"}):
            for path in GUARDED_GETS:
                assert_refused(http.get(path, headers=headers))
            for path in GUARDED_POSTS:
                body = {"data": [str(default_model_dir), "", None], "fn_index": 0, "session_hash": "s"}
                assert_refused(http.post(path, json=body, headers=headers))
            for fn in ("load_model", "add_model", "respond"):  # not even the event stream of a made-up call
                assert_refused(http.get(f"/gradio_api/call/{fn}/0123456789abcdef", headers=headers))
    assert not (home / "ui-models.json").exists(), "a refused add_model call still added the folder"


def test_a_browser_without_a_session_is_sent_to_the_login_page(keyed):
    with httpx.Client(base_url=keyed, timeout=30) as http:
        for path, target in (("/", "%2F"), ("/docs", "%2Fdocs"), ("/?view=api", "%2F%3Fview%3Dapi")):
            r = http.get(path, headers=HTML)
            assert r.status_code == 303 and r.headers["location"] == f"/login?next={target}", path
        assert_refused(http.get("/v1/models", headers=HTML))  # the API keeps its 401, browser or not


# ---- with --api-key: the key opens it ------------------------------------------------------------------------
def test_the_bearer_key_opens_the_page_and_gradio_api(keyed, home, default_model_dir):
    with httpx.Client(base_url=keyed, timeout=60, headers=BEARER) as http:
        page = http.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "auth_required" not in page.text and "load_model" in page.text  # the app's config, not a login
        info = http.get("/gradio_api/info").json()
        assert {"/respond", "/load_model", "/add_model"} <= set(info["named_endpoints"])
        for path in ("/config", "/docs", "/openapi.json", "/metrics", "/version"):
            assert http.get(path).status_code == 200, path
        event, result = call(http, "add_model", [str(default_model_dir), "", None])
        assert event == "complete" and "Added" in result[0], result
        added = json.loads((home / "ui-models.json").read_text())["models"]
        assert [m["path"] for m in added] == [str(default_model_dir.resolve())]
        event, result = call(http, "load_model", [hub_model(), ""])
        assert event == "complete" and "not downloaded yet" in result[1], result  # it ran (and refused)
        event, result = call(http, "respond", ["Hi", "", 0, 1, 0, 4, "", ""])
        assert event == "complete" and "tok/s" in json.dumps(result), result


def test_gradio_client_works_with_the_bearer_header_or_a_login(keyed):
    from gradio_client import Client

    for kwargs in ({"headers": BEARER}, {"auth": ("pagoda", KEY)}):
        client = Client(keyed, verbose=False, download_files=False, analytics_enabled=False, **kwargs)
        result = client.predict("Hi", "", 0, 1, 0, 4, "", "", api_name="/respond")
        assert "tok/s" in json.dumps(result), result
    with pytest.raises(Exception, match="(?i)credentials|401|login"):
        Client(keyed, verbose=False, download_files=False, analytics_enabled=False, auth=("pagoda", "wrong"))


def test_the_login_page_opens_a_session_that_logout_closes(keyed):
    origin = {"Origin": keyed}
    with httpx.Client(base_url=keyed, timeout=60) as http:
        wrong = http.post("/login", data={"key": "wrong", "next": "/"}, headers=HTML)
        assert wrong.status_code == 401 and "not this server's API key" in wrong.text
        assert "pagoda-session" not in http.cookies
        r = http.post("/login", data={"key": KEY, "next": "/docs"}, headers={**HTML, **origin})
        assert r.status_code == 303 and r.headers["location"] == "/docs"
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=lax" in cookie and KEY.lower() not in cookie
        token = http.cookies["pagoda-session"]
        assert http.get("/").status_code == 200 and http.get("/docs").status_code == 200
        assert {"/respond", "/add_model"} <= set(http.get("/gradio_api/info").json()["named_endpoints"])
        event, result = call(http, "load_model", [hub_model(), ""], headers=origin)
        assert event == "complete" and "not downloaded yet" in result[1], result
        # the cookie alone is not enough from another site's page
        assert_refused(http.post("/gradio_api/call/load_model", json={"data": ["x", ""]},
                                 headers={"Origin": "http://evil.example"}))
        out = http.get("/logout")
        assert out.status_code == 303 and out.headers["location"] == "/login"
    with httpx.Client(base_url=keyed, timeout=30, cookies={"pagoda-session": token}) as stale:
        assert_refused(stale.get("/gradio_api/info"))


def test_login_redirects_only_to_this_server(keyed):
    with httpx.Client(base_url=keyed, timeout=30) as http:
        for target in ("//evil.example/", "http://evil.example/", "/\\evil.example", "/login?next=/login"):
            r = http.post("/login", data={"key": KEY, "next": target}, headers=HTML)
            assert r.status_code == 303 and r.headers["location"] == "/", target
        programmatic = http.post("/login", data={"password": KEY})  # gradio_client's form, JSON back
        assert programmatic.status_code == 200 and programmatic.json() == {"success": True}


# ---- without a key on loopback: nothing changes ---------------------------------------------------------------
def test_without_a_key_on_loopback_nothing_asks_for_one(keyless):
    with httpx.Client(base_url=keyless, timeout=60) as http:
        page = http.get("/", headers=HTML)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert {"/respond", "/load_model"} <= set(http.get("/gradio_api/info").json()["named_endpoints"])
        event, result = call(http, "respond", ["Hi", "", 0, 1, 0, 4, "", ""])
        assert event == "complete" and "tok/s" in json.dumps(result)
        for path in ("/metrics", "/docs", "/version", "/v1/models"):
            assert http.get(path).status_code == 200, path


# ---- layering: the engine never imports the UI ---------------------------------------------------------------
def test_the_engine_does_not_import_the_ui():
    """engine/ (serving included) imports no ``ui`` module, directly or through importlib; app.py mounts it."""
    offenders = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                names = [str(node.args[0].value)]
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                          if n == "ui" or n.startswith("ui.")]
    assert not offenders, offenders
