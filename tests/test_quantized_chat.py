"""Issue 4: the bundled AWQ and GPTQ builds of the default model run in the engine and still answer sensibly."""

from __future__ import annotations

import json

import pytest

from engine import SamplingParams


@pytest.mark.parametrize("fixture, method", [("awq_model_dir", "awq"), ("gptq_model_dir", "gptq")])
def test_quantized_default_model_answers_paris(request, fixture, method):
    from engine import LLM

    model_dir = request.getfixturevalue(fixture)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == method
    llm = LLM(str(model_dir), dtype="float32", device="cpu", kv_cache_memory="64MiB")
    weights = llm.engine.runner.weight_bytes
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    assert "Paris" in out.text, out.text
    # the linear layers really are packed int4: far smaller than the fp32 model's 538 MB
    assert weights < 300 * 2**20
