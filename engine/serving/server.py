"""Builds the one FastAPI app that serves the API and the UI around one engine."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine


def build_server(args: EngineArgs, api_key: str | None = None, host: str = "127.0.0.1", port: int = 7860) -> FastAPI:
    """Load the model first (so /health is 200 only when it serves), then return the app."""
    engine = LLMEngine(args)
    app = FastAPI(title="Pagoda")
    app.state.engine = engine

    @app.get("/health")
    def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "model": engine.model_name})

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return f"<html><body><h1>Pagoda</h1><p>Serving {engine.model_name}.</p></body></html>"

    return app
