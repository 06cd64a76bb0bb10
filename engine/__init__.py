"""Pagoda's inference engine: paged KV cache, continuous batching, Llama-family models, AWQ/GPTQ weights.

Public API (vLLM-shaped): ``LLM``, ``SamplingParams``, ``EngineArgs``, ``RequestOutput``, ``LLMEngine``.
``AsyncEngine`` lives in engine/async_engine.py (imported lazily by the server); its loop thread in
engine/engine_loop.py, request streams in engine/streams.py, errors in engine/errors.py.
"""

from engine.config import EngineArgs
from engine.errors import EngineError
from engine.request import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput", "EngineError"]


def __getattr__(name: str):
    # LLM pulls in torch, transformers and the model code: import it only when asked for.
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
