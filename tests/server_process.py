"""Start `python app.py serve` on a free port for the server and UI tests, and stop it afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.serving import free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["free_port", "launch_server", "serving"]


@contextmanager
def serving(cmd: list[str], env: dict, stdout, stderr, read_log: Callable[[], str],
            startup_timeout: float = 240.0) -> Iterator[str]:
    """Start ``cmd`` (an ``app.py serve ... --port N``), yield its base URL once /health answers, stop it after.
    ``read_log`` gives the output to show when the server does not come up."""
    port = cmd[cmd.index("--port") + 1]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=stdout, stderr=stderr, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {read_log()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        yield url
    finally:
        stop_process(proc)


@contextmanager
def launch_server(model_dir: Path, *flags: str, ui: bool = True, startup_timeout: float = 240.0,
                  env: dict[str, str] | None = None) -> Iterator[str]:
    """``python app.py serve --model <dir> --port <free> --dtype float32 <flags>``; yields the base URL once
    /health answers; stops the process afterwards. ``ui=False`` serves the API alone (``--no-ui``: faster
    start); ``env`` adds to (or overrides) this process's environment. Shared by the server test modules."""
    port = free_port()
    cmd = [sys.executable, str(ROOT / "app.py"), "serve", "--model", str(model_dir), "--port", str(port),
           "--dtype", "float32", "--log-level", "warning", *([] if ui else ["--no-ui"]), *flags]
    env = {**{k: v for k, v in os.environ.items() if k != "PAGODA_API_KEY"}, **(env or {})}
    with tempfile.TemporaryFile() as log:
        def read_log() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")

        with serving(cmd, env, log, subprocess.STDOUT, read_log, startup_timeout) as url:
            yield url
