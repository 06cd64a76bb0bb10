"""Start-up time: from process start to ready-to-serve a 7B-shape AWQ model from local disk (page cache warm).

Run on the GPU machine: ``python3 bench/startup.py [--out bench/results/startup.json]``. Two clocks, each
started just before ``subprocess.Popen`` of a fresh Python process (interpreter start, imports, weight
loading and repacking, KV sizing, CUDA graph capture all count):

- ``server`` (the target, <= 5 s): ``python3 app.py serve --model <folder> --no-ui --port P`` until
  ``/health`` answers 200 with the model loaded (polled every 20 ms); then the time of one 1-token completion
  is recorded as information.
- ``offline``: ``LLM(<folder>, ...)`` constructed and one token generated, in a child process that prints a
  line when done (information).
- ``imports``: a fresh Python importing the engine and server modules, no model (information: the floor).

Before timing, every file of the model folder is read once (page cache warm), and ``--warmup-starts`` untimed
starts run first so that on-disk compile caches (Triton's) are as warm as on a user's second start; the first
start is reported as information. Medians of ``--repeats`` server starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    ROOT,
    BenchRun,
    add_common_args,
    at_most,
    engine_cli_flags,
    engine_kwargs,
    info,
    model_for,
    shape_label,
)
from bench.serving import free_port, running_server, server_command, stop_process

OFFLINE_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from engine import LLM, SamplingParams
llm = LLM(sys.argv[2], **json.loads(sys.argv[3]))
params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params)
assert len(out[0].outputs[0].token_ids) == 1
print("PAGODA-READY", flush=True)
"""


def warm_page_cache(folder: Path) -> int:
    """Read every file once so the weights come from the page cache; returns bytes read."""
    total = 0
    for path in sorted(folder.iterdir()):
        if path.is_file():
            with path.open("rb") as f:
                while chunk := f.read(64 << 20):
                    total += len(chunk)
    return total


def server_start(model_dir: Path, flags: list[str], timeout: float) -> tuple[float, float]:
    """(seconds from Popen to /health 200, seconds of one 1-token completion right after)."""
    with running_server(server_command(model_dir, free_port(), flags), timeout) as (url, ready, _):
        start = time.perf_counter()
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
        resp = httpx.post(f"{url}/v1/completions", timeout=120, json=body)
        resp.raise_for_status()
        return ready, time.perf_counter() - start


def offline_start(model_dir: Path, kwargs: dict, timeout: float) -> float:
    """Seconds from Popen of a fresh Python to its line saying LLM(...) is built and one token generated."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-c", OFFLINE_CHILD, str(ROOT), str(model_dir), json.dumps(kwargs)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        for line in proc.stdout:
            if line.strip() == "PAGODA-READY":
                return time.perf_counter() - start
            if time.perf_counter() - start > timeout:
                break
        proc.wait(timeout=timeout)
        raise RuntimeError(f"offline start failed (exit {proc.returncode}): {proc.stderr.read()[-3000:]}")
    finally:
        stop_process(proc)


def imports_only(timeout: float) -> float:
    """Seconds for a fresh Python to import the engine and server stack and exit: the floor under a start."""
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import engine.llm, engine.serving.server, uvicorn"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=timeout)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "startup")
    parser.add_argument("--modes", default="imports,server,offline",
                        help="comma-separated: imports, server, offline")
    parser.add_argument("--repeats", type=int, default=2, help="timed server starts (median)")
    parser.add_argument("--offline-repeats", type=int, default=1, help="timed offline starts (median)")
    parser.add_argument("--warmup-starts", type=int, default=1,
                        help="untimed starts before the timed ones (on-disk compile caches)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one start may take")
    args = parser.parse_args()
    run = BenchRun("startup", args)
    label = f"{shape_label(args, 'llama2-7b')} AWQ"
    kwargs = engine_kwargs(args)
    flags = engine_cli_flags(kwargs)
    modes = args.modes.split(",")
    with run.section("build and warm the page cache"):
        model_dir = model_for(args, "llama2-7b", "awq")
        run.add(info(f"{label}: folder read into the page cache", warm_page_cache(model_dir) / 2**30, "GiB"))
    if "imports" in modes:
        with run.section("imports"):
            run.add(info("python start + imports of the engine and server (no model)",
                         imports_only(args.timeout), "s"))
    if args.warmup_starts and ("server" in modes or "offline" in modes):
        with run.section("untimed first start"):
            for _ in range(args.warmup_starts):
                if "server" in modes:
                    first = server_start(model_dir, flags, args.timeout)[0]
                else:
                    first = offline_start(model_dir, kwargs, args.timeout)
            run.add(info(f"{label}: first start of the run ({'server' if 'server' in modes else 'offline'}, "
                         "compile caches as found)", first, "s"))
    if "server" in modes:
        with run.section("server start"):
            times = [server_start(model_dir, flags, args.timeout) for _ in range(args.repeats)]
            ready = statistics.median(t for t, _ in times)
            run.add(at_most(f"{label}: server process start to /health 200 (page cache warm)", ready, "s", 5),
                    info(f"{label}: first completion (1 token) right after /health",
                         statistics.median(c for _, c in times) * 1e3, "ms"))
    if "offline" in modes:
        with run.section("offline start"):
            seconds = statistics.median(offline_start(model_dir, kwargs, args.timeout)
                                        for _ in range(args.offline_repeats))
            run.add(info(f"{label}: python start to LLM(...) built + 1 token generated", seconds, "s"))
    run.finish()


if __name__ == "__main__":
    main()
