"""Pagoda's inference engine: paged KV cache, continuous batching, Llama-family models, AWQ/GPTQ weights.

Public API (vLLM-shaped): ``LLM``, ``SamplingParams``, ``EngineArgs``, ``RequestOutput``, ``LLMEngine``.
``AsyncEngine`` lives in engine/async_engine.py (imported lazily by the server); its loop thread in
engine/engine_loop.py, request streams in engine/streams.py, errors in engine/errors.py.

The names are imported when first asked for: most of them pull in torch, which a process that needs only a
light module (the grammar process, engine/grammar_worker.py) should not pay for.
"""

import importlib

_HOMES = {"LLM": "engine.llm", "LLMEngine": "engine.llm_engine", "EngineArgs": "engine.config",
          "EngineError": "engine.errors", "SamplingParams": "engine.request", "RequestOutput": "engine.request",
          "CompletionOutput": "engine.request"}

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "EngineError", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(name)
    return getattr(importlib.import_module(_HOMES[name]), name)
