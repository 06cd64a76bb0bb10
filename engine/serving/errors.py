"""OpenAI-shaped error bodies and the exception handlers that guarantee bad input is a 4xx, never a 5xx.

Every error the API returns has the shape OpenAI's clients parse:
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineError, EngineStepError, EngineUnavailableError

log = logging.getLogger("pagoda.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 422: "invalid_request_error", 503: "service_unavailable_error"}


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes", "literal", "union"}


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}


class APIError(Exception):
    """An error with an HTTP status, raised by the routes and the guard middleware."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class ClientDisconnected(Exception):
    """The client went away while its request was being prepared or generated (nobody to answer)."""


def error_payload(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error_payload(error.message, error.type, error.param, error.code), error.status,
                        headers=headers)


async def send_error(send, error: APIError) -> None:
    """The same body from raw ASGI (the guards answer before any route runs)."""
    body = json.dumps(error_payload(error.message, error.type, error.param, error.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def to_api_error(exc: BaseException) -> APIError:
    """The one mapping from exceptions to HTTP errors (JSON bodies and SSE error events share it)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError):
        return APIError(400, exc.message, exc.param, exc.code)
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, exc.message, None, exc.code)
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), None, "engine_error", "server_error")
    log.error("unexpected error", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}", None, "internal_error", "server_error")


def validation_param(loc: tuple | list) -> str | None:
    """FastAPI's error location -> OpenAI's ``param``: ('body', 'messages', 0, 'role') -> 'messages[0].role'."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif str(part) in _UNION_TAGS or any(c in str(part) for c in "[(-"):  # pydantic union-member tags
            continue
        else:
            text += f".{part}" if text else str(part)
    return text or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(),
                        None, "invalid_json")
    param = validation_param(first.get("loc", ()))
    if param is None and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        hint = (" sent with 'Content-Type: application/json'" if isinstance(first.get("input"), (bytes, str))
                else "")
        return APIError(400, f"the request body must be a JSON object{hint} with the fields of this endpoint",
                        None, "invalid_body")
    detail = first.get("msg", "invalid value")
    extra = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return APIError(400, f"{param or 'body'}: {detail}{extra}", param, "invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through ``to_api_error`` so the body is always OpenAI-shaped."""

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(EngineError)
    async def on_engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return error_response(to_api_error(exc))

    @app.exception_handler(EngineUnavailableError)
    async def on_unavailable(_: Request, exc: EngineUnavailableError) -> JSONResponse:
        return error_response(to_api_error(exc))

    @app.exception_handler(EngineStepError)
    async def on_step_error(_: Request, exc: EngineStepError) -> JSONResponse:
        # its own handler: the catch-all below runs in Starlette's outermost middleware, which re-raises after
        # answering, and the server then drops the client's keep-alive connection
        return error_response(to_api_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return error_response(APIError(exc.status_code, message, None, _HTTP_CODES.get(exc.status_code)))

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; never read by anyone

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc))
