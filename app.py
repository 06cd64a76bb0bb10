"""Pagoda's command line: ``serve`` (default) the UI + OpenAI API, ``fetch`` a model, ``quantize`` a model.

``serve`` wires the layers: it builds the engine and the API app (engine.serving) and mounts the UI (ui) on it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import fields

from engine.config import EngineArgs
from engine.errors import EngineError

DEFAULT_MODEL = "smollm2-135m-instruct"


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Engine flags under vLLM's names (--max-model-len, --gpu-memory-utilization, ...)."""
    defaults = EngineArgs()
    parser.add_argument("--model", default=DEFAULT_MODEL, help="catalog id (models.yaml) or a local model folder")
    parser.add_argument("--dtype", default=defaults.dtype, choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--device", default=defaults.device, help="auto, cpu or cuda[:N]")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--block-size", type=int, default=defaults.block_size, choices=[8, 16, 32])
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=defaults.enable_prefix_caching)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=defaults.enable_chunked_prefill)
    parser.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization)
    parser.add_argument("--gpu-memory-limit", default=None, help="absolute GPU budget, e.g. 20GiB")
    parser.add_argument("--kv-cache-memory", default=None, help="explicit KV cache size, e.g. 512MiB (CPU default 256MiB)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=defaults.tensor_parallel_size,
                        help="split the model over this many devices (one worker process each)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=defaults.async_scheduling,
                        help="schedule each decode step while the previous one runs (its tokens read on the device)")
    parser.add_argument("--lm-head-quantization", default=defaults.lm_head_quantization, choices=["none", "int8"],
                        help="int8: hold the LM head as int8 rows (half its bytes a token, logits change slightly; "
                             "llama.cpp's Q4 files keep it at Q6_K); none: as the checkpoint has it")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})


def ui_wanted(ns: argparse.Namespace) -> bool:
    """``--no-ui`` or ``PAGODA_UI=0`` serve the API alone (a headless server starts faster)."""
    return not ns.no_ui and os.environ.get("PAGODA_UI", "1").strip().lower() not in ("0", "false", "no", "off")


def mount_ui(app) -> None:
    """The Gradio UI at "/" of the API's app, under the API's rules: behind the key when there is one (the
    server's guard and Gradio's own check), local folders and downloads only where the server settings allow."""
    import ui
    from ui.client import EngineClient
    from ui.model_manager import ModelManager

    engine, settings, access = app.state.engine, app.state.settings, app.state.access
    models = ModelManager(engine, allow_local_paths=settings.allow_local_paths,
                          allow_downloads=settings.allow_downloads)
    client = EngineClient(engine, host=settings.host, port=settings.port, api_key_required=access is not None,
                          models=models)
    ui.mount(app, client, auth_dependency=access.user if access is not None else None)


def cmd_serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from engine.serving.server import build_server

    app = build_server(engine_args_from(ns), api_key=ns.api_key or os.environ.get("PAGODA_API_KEY"),
                       host=ns.host, port=ns.port, mount=mount_ui if ui_wanted(ns) else None)
    print(f"Pagoda serving on http://{ns.host}:{ns.port}  (OpenAI API at http://{ns.host}:{ns.port}/v1)", flush=True)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level, timeout_graceful_shutdown=3)
    return 0


def cmd_fetch(ns: argparse.Namespace) -> int:
    from engine.catalog import Catalog, fetch

    catalog = Catalog.load()
    entry = catalog.get(ns.model)
    if entry is None:
        raise EngineError(f"unknown catalog id {ns.model!r}; known: {', '.join(sorted(catalog.entries))}")
    path = fetch(entry, catalog, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(path)
    return 0


def cmd_quantize(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.catalog import resolve_model
    from engine.quant.quantizer import quantize_model

    src, name = resolve_model(ns.model, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    out = Path(ns.out) if ns.out else src.parent / f"{name}-{ns.method}-g{ns.group_size}"
    path = quantize_model(src, out, method=ns.method, group_size=ns.group_size, desc_act=ns.act_order,
                          device=ns.device, log=lambda msg: print(msg, flush=True))
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="app.py", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="serve the web UI and the OpenAI-compatible API (default)")
    add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=7860)
    serve.add_argument("--api-key", default=None,
                       help="require this key for everything but /health: the API as a bearer key, the UI "
                            "through a login page (or set PAGODA_API_KEY)")
    serve.add_argument("--no-ui", action="store_true", help="serve the API alone (faster start, no Gradio)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=cmd_serve)
    fetch = sub.add_parser("fetch", help="download or build a catalog model; prints its folder last")
    fetch.add_argument("model")
    fetch.set_defaults(func=cmd_fetch)
    quant = sub.add_parser("quantize", help="quantize a model to a Hub-compatible AWQ or GPTQ checkpoint")
    quant.add_argument("model", help="catalog id or local folder")
    quant.add_argument("--method", choices=["awq", "gptq", "rtn"], required=True)
    quant.add_argument("--group-size", type=int, default=128)
    quant.add_argument("--act-order", action="store_true", help="GPTQ act-order (desc_act)")
    quant.add_argument("--device", default=None)
    quant.add_argument("--out", default=None)
    quant.set_defaults(func=cmd_quantize)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        argv = ["serve", *argv]
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except EngineError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
