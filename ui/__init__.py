"""Pagoda's Gradio UI, mounted at "/" in the same FastAPI app as the OpenAI API: ``mount(app, client)``."""

from __future__ import annotations

import contextlib
from typing import Any


def mount(app, client: Any):
    """Mount the UI on ``app`` at "/" (no second server) and return the app.

    ``client`` is an ``EngineClient`` or the server's ``AsyncEngine`` (wrapped here, with the host, port and
    API-key facts the server put in ``app.state.settings``). The client is closed when the app shuts down
    (its sampler thread stops and running downloads are cancelled, staying resumable).
    """
    import gradio as gr

    from ui.app import CSS, build_blocks, theme
    from ui.client import EngineClient
    from ui.model_manager import ModelManager

    if not isinstance(client, EngineClient):
        settings = getattr(app.state, "settings", None)
        client = EngineClient(client, host=getattr(settings, "host", "127.0.0.1"),
                              port=getattr(settings, "port", 7860),
                              api_key_required=bool(getattr(settings, "api_key", None)),
                              models=ModelManager(client,
                                                  allow_local_paths=getattr(settings, "allow_local_paths", True)))
    app.state.ui_client = client
    blocks = build_blocks(client)
    blocks.queue(default_concurrency_limit=8)
    app = gr.mount_gradio_app(app, blocks, path="/", ssr_mode=False, footer_links=[], theme=theme(), css=CSS)
    serve = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        try:
            async with serve(a) as state:
                yield state
        finally:
            client.close()

    app.router.lifespan_context = lifespan
    return app
