"""Pagoda's Gradio UI, mounted at "/" in the same FastAPI app as the OpenAI API: ``mount(app, client)``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any


def mount(app, client, *, auth_dependency: Callable[[Any], str | None] | None = None):
    """Mount the UI on ``app`` at "/" (no second server) and return the app.

    ``client`` is the ``EngineClient`` the tabs talk to (``app.py`` builds it with the server's host, port,
    key and local-folder/download policy); it is closed when the app shuts down (its sampler thread stops and
    running downloads are cancelled, staying resumable). ``auth_dependency`` (request -> user or None) is
    Gradio's own check on its page and API routes, for a server with a key; the server's guard in front of the
    whole app makes the same decision first.
    """
    import gradio as gr

    from ui.app import CSS, build_blocks, theme

    app.state.ui_client = client
    blocks = build_blocks(client)
    blocks.queue(default_concurrency_limit=8)
    app = gr.mount_gradio_app(app, blocks, path="/", ssr_mode=False, footer_links=[], theme=theme(), css=CSS,
                              auth_dependency=auth_dependency)
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
