"""Issue 6: the fit estimator's numbers against what the engine really allocates, and the refusal path."""

from __future__ import annotations

import pytest

from engine.config import ModelConfig
from engine.errors import EngineError
from engine.fit import check_fit, estimate_weight_bytes


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_estimate_matches_engine_allocation(default_model_dir, dtype):
    import torch

    from engine import LLM

    llm = LLM(str(default_model_dir), dtype=dtype, device="cpu", kv_cache_memory="48MiB")
    runner = llm.engine.runner
    config = ModelConfig.from_path(default_model_dir)
    torch_dtype = getattr(torch, dtype)
    report = check_fit(config, torch_dtype, budget_bytes=runner.weight_bytes + 48 * 2**20,
                       kv_cache_bytes=48 * 2**20, activation_reserve_bytes=0)
    assert abs(estimate_weight_bytes(config, torch_dtype) - runner.weight_bytes) <= 0.05 * runner.weight_bytes
    assert abs(report.num_blocks - runner.layout.num_blocks) <= 0.05 * runner.layout.num_blocks
    assert report.max_context_tokens == runner.layout.capacity_tokens
    assert report.kv_bytes_per_token == config.kv_bytes_per_token(torch_dtype)


def test_model_that_cannot_hold_one_request_is_refused_with_numbers(default_model_dir):
    from engine import LLM

    with pytest.raises(EngineError) as info:
        LLM(str(default_model_dir), dtype="float32", device="cpu", kv_cache_memory="8MiB", max_model_len=8192)
    message = str(info.value)
    assert info.value.param == "max_model_len"
    assert "MiB" in message and "max-model-len" in message.replace("_", "-")
    # the suggestion really fits
    suggested = int("".join(ch for ch in message.split("max-model-len")[-1].split()[0] if ch.isdigit())) \
        if "max-model-len" in message else None
    assert suggested and suggested < 8192
    llm = LLM(str(default_model_dir), dtype="float32", device="cpu", kv_cache_memory="8MiB",
              max_model_len=suggested)
    assert llm.engine.max_model_len == suggested
