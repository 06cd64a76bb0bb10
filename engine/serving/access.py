"""The API key in front of everything: with ``--api-key`` only ``/health`` and the login page answer without it.

Two ways in, one check: a program sends the key as ``Authorization: Bearer <key>`` (or ``X-API-Key``); a browser
logs in once at ``/login`` and then carries an opaque session cookie (a random token this process keeps, never
the key; SameSite=Lax, HttpOnly; lost on restart). ``AccessGuard`` runs before any route, the Gradio UI's
included, so a route that forgets to check cannot leak; ``KeyAccess.user`` is also handed to Gradio as its
``auth_dependency`` so the UI's own checks agree. Without a key no guard is installed and nothing changes.
"""

from __future__ import annotations

import hmac
import html
import secrets
import threading
from collections import OrderedDict
from urllib.parse import parse_qs, quote, urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.requests import HTTPConnection

from engine.serving.errors import APIError, error_response, send_error

SESSION_COOKIE = "pagoda-session"
LOGIN_PATH, LOGOUT_PATH = "/login", "/logout"
OPEN_PATHS = frozenset({"/health", LOGIN_PATH, LOGOUT_PATH})  # /health: the liveness probe
MAX_SESSIONS = 1024
MAX_LOGIN_BODY = 8192


class KeyAccess:
    """Who may use a server that has a key: the key in a header, or a session opened by logging in."""

    def __init__(self, key: str, max_sessions: int = MAX_SESSIONS):
        self._key = key.encode()
        self._sessions: OrderedDict[str, None] = OrderedDict()  # oldest first; the oldest go past the cap
        self._lock = threading.Lock()
        self.max_sessions = max_sessions

    def is_key(self, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self._key)

    def key_in(self, conn: HTTPConnection) -> bool:
        auth = conn.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else conn.headers.get("x-api-key", "")
        return bool(given) and self.is_key(given)

    def open_session(self) -> str:
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._sessions[token] = None
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return token

    def close_session(self, token: str | None) -> None:
        with self._lock:
            self._sessions.pop(token or "", None)

    def session_in(self, conn: HTTPConnection) -> bool:
        """A valid session cookie sent from this server's own pages (the Origin check stops cross-site use)."""
        token = conn.cookies.get(SESSION_COOKIE)
        with self._lock:
            known = token is not None and token in self._sessions
        return known and same_origin(conn)

    def allows(self, conn: HTTPConnection) -> bool:
        return self.key_in(conn) or self.session_in(conn)

    def user(self, request: Request) -> str | None:
        """Gradio's ``auth_dependency``: a user name when the request may use the UI, else None (a 401)."""
        return "pagoda" if self.allows(request) else None


def same_origin(conn: HTTPConnection) -> bool:
    origin = conn.headers.get("origin")
    return origin is None or urlsplit(origin).netloc == conn.headers.get("host", "")


def local_path(target: str | None) -> str:
    """Where to go after logging in: a path on this server, never another site (no open redirect)."""
    if not target or not target.startswith("/") or target.startswith(("//", "/\\", LOGIN_PATH)):
        return "/"
    return target


class AccessGuard:
    """ASGI middleware: every path but ``OPEN_PATHS`` wants the key or a session.

    Refusals: a browser opening a page is sent to the login page; API paths and everything else get a 401 in
    OpenAI's error shape (``invalid_api_key``, as the API always answered); a websocket is closed before it opens.
    """

    def __init__(self, app, access: KeyAccess, api_prefixes: tuple[str, ...] = ()):
        self.app = app
        self.access = access
        self.api_prefixes = api_prefixes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        conn = HTTPConnection(scope)
        if self.access.allows(conn):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        path = scope["path"]
        if (scope["method"] in ("GET", "HEAD") and "text/html" in conn.headers.get("accept", "")
                and not path.startswith(self.api_prefixes)):
            query = scope.get("query_string", b"").decode("latin-1")
            target = quote(path + (f"?{query}" if query else ""), safe="")
            await RedirectResponse(f"{LOGIN_PATH}?next={target}", status_code=303)(scope, receive, send)
            return
        if path.startswith(self.api_prefixes):
            message = "invalid or missing API key: send 'Authorization: Bearer <key>'"
        else:
            message = f"this server wants its API key: send 'Authorization: Bearer <key>' or log in at {LOGIN_PATH}"
        await send_error(send, APIError(401, message, None, "invalid_api_key"))


def build_router(access: KeyAccess) -> APIRouter:
    """``GET/POST /login`` (the key in a form: a session cookie) and ``GET /logout``."""
    router = APIRouter(include_in_schema=False)

    @router.get(LOGIN_PATH)
    async def login_page(next: str = "/") -> HTMLResponse:
        return HTMLResponse(login_html(local_path(next)))

    @router.post(LOGIN_PATH)
    async def login(request: Request) -> Response:
        """Form fields ``key`` (the page) or ``password`` (gradio_client's ``auth=(any, key)``), ``next``.
        A browser form is redirected on; a program gets JSON (200, or 401 with OpenAI's error shape)."""
        browser = "text/html" in request.headers.get("accept", "")
        form = await read_form(request)
        target = local_path(form.get("next"))
        given = form.get("key") or form.get("password") or ""
        if not same_origin(request) or not given or not access.is_key(given):
            if browser:
                return HTMLResponse(login_html(target, failed=True), status_code=401)
            return error_response(APIError(401, "wrong API key", None, "invalid_api_key"))
        response: Response = (RedirectResponse(target, status_code=303) if browser
                              else JSONResponse({"success": True}))
        response.set_cookie(SESSION_COOKIE, access.open_session(), httponly=True, samesite="lax",
                            secure=request.url.scheme == "https", path="/")
        return response

    @router.get(LOGOUT_PATH)
    async def logout(request: Request) -> Response:
        access.close_session(request.cookies.get(SESSION_COOKIE))
        response = RedirectResponse(LOGIN_PATH, status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    return router


async def read_form(request: Request) -> dict[str, str]:
    """A small url-encoded form (first value of each field); larger bodies are cut off, not buffered."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_LOGIN_BODY:
            return {}
    fields = parse_qs(body.decode("utf-8", errors="replace"), max_num_fields=8)
    return {name: values[0] for name, values in fields.items()}


def login_html(target: str, failed: bool = False) -> str:
    """The login page: one password field, no script, no external resources (it is served to anyone)."""
    error = "<p class='error' role='alert'>That is not this server's API key.</p>" if failed else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Pagoda · log in</title>
<style>
body {{ font-family: ui-sans-serif, system-ui, -apple-system, "Segoe UI", sans-serif; background: #f8fafc;
       color: #1e293b; display: flex; min-height: 100vh; margin: 0; align-items: center; justify-content: center; }}
form {{ background: #fff; border: 1px solid #e2e8f0; border-radius: 12px; padding: 28px 32px; width: 340px;
       box-shadow: 0 1px 3px rgba(0, 0, 0, .06); }}
h1 {{ font-size: 1.3rem; margin: 0 0 4px; }} p {{ font-size: .9rem; color: #475569; margin: 0 0 16px; }}
label {{ font-weight: 600; font-size: .9rem; display: block; margin-bottom: 6px; }}
input[type=password] {{ width: 100%; box-sizing: border-box; padding: 9px 10px; border: 1px solid #cbd5e1;
                       border-radius: 8px; font-size: 1rem; margin-bottom: 16px; }}
button {{ width: 100%; padding: 10px; border: 0; border-radius: 8px; background: #4f46e5; color: #fff;
         font-size: 1rem; font-weight: 600; cursor: pointer; }}
.error {{ color: #842029; background: #fff5f5; border: 1px solid #f5c2c7; border-radius: 8px; padding: 8px 10px; }}
</style></head>
<body><form method="post" action="{LOGIN_PATH}" id="login-form">
<h1>Pagoda</h1><p>This server was started with <code>--api-key</code>: enter that key to continue.</p>{error}
<label for="key">API key</label>
<input type="password" id="key" name="key" autocomplete="current-password" autofocus required>
<input type="hidden" name="next" value="{html.escape(target, quote=True)}">
<button type="submit" id="login-submit">Log in</button>
</form></body></html>
"""
