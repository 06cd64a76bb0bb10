"""Issue 14: the bundled AWQ and GPTQ builds of the default model keep what a user relies on, on any machine.

No assertion hangs on one greedy answer of a 4-bit 135M model. Each build is compared with the fp16 model
it came from on held-out text (perplexity ratio, teacher-forced top-1 agreement: how often it would pick the
fp16 model's next token) and must answer k of n short factual questions, through the engine, that the fp16
model answers. The bounds were set from builds made in float32 with 1 and 2 threads (which differed from each
other, as builds on different machines did) and from the float64 builds now shipped; the measurements are in
BENCHMARKS.md ("Bundled quantized builds: quality bounds").
"""

from __future__ import annotations

import json
import re

import pytest

from engine import LLM, SamplingParams

BUILDS = [("awq_model_dir", "awq"), ("gptq_model_dir", "gptq")]
# Measured (BENCHMARKS.md): perplexity ratio 1.071-1.095 over six builds (float32 on two machines, float64),
# top-1 agreement 0.813-0.835 and 10-12 of 12 facts over the four made here; each bound leaves about the
# spread again beyond the worst build.
MAX_PERPLEXITY_RATIO = 1.12  # quantized / fp16 perplexity on data/heldout.txt
MIN_TOP1_AGREEMENT = 0.78  # fraction of held-out positions where the greedy next token matches fp16's
# Questions the fp16 default model answers correctly (greedy, 32 tokens); answers matched as regexes.
FACTS = [("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
         ("What is the capital of Germany?", "Berlin"), ("What is the capital of England?", "London"),
         ("What is the capital of Russia?", "Moscow"), ("What is the capital of China?", "Beijing"),
         ("What color is the sky on a clear day?", "blue"), ("Who wrote Romeo and Juliet?", "Shakespeare"),
         ("What is the chemical symbol for water?", "H2O"), ("How many days are there in a week?", r"\b(7|seven)\b"),
         ("What is the opposite of hot?", "cold"), ("What gas do plants absorb from the air?", r"carbon dioxide|CO2")]
MIN_FACTS_CORRECT = 8


def answers(model_dir) -> tuple[list[str], int]:
    """Greedy answers of the engine (packed int4 kernels for quantized builds) and the engine's weight bytes."""
    llm = LLM(str(model_dir), dtype="float32", device="cpu", kv_cache_memory="64MiB")
    outputs = llm.chat([[{"role": "user", "content": question}] for question, _ in FACTS],
                       SamplingParams(temperature=0.0, max_tokens=32))
    return [out.outputs[0].text for out in outputs], llm.engine.runner.weight_bytes


def correct(texts: list[str]) -> list[bool]:
    return [re.search(pattern, text, re.IGNORECASE) is not None for (_, pattern), text in zip(FACTS, texts)]


def test_fp16_default_model_answers_every_fact(default_model_dir):
    """The yardstick itself: the questions are ones the unquantized model gets right (one slip allowed)."""
    texts, _ = answers(default_model_dir)
    assert sum(correct(texts)) >= len(FACTS) - 1, list(zip([q for q, _ in FACTS], texts))


@pytest.mark.parametrize("fixture, method", BUILDS)
def test_quantized_build_tracks_fp16_on_heldout_text(request, fixture, method, heldout_agreement):
    model_dir = request.getfixturevalue(fixture)
    assert json.loads((model_dir / "config.json").read_text())["quantization_config"]["quant_method"] == method
    result = heldout_agreement(model_dir)  # evaluate.compare of the dequantized build with fp16
    print(f"{method}: {result}")
    assert result.perplexity_ratio <= MAX_PERPLEXITY_RATIO, result
    assert result.top1_agreement >= MIN_TOP1_AGREEMENT, result


@pytest.mark.parametrize("fixture, method", BUILDS)
def test_quantized_build_answers_factual_questions(request, fixture, method):
    texts, weight_bytes = answers(request.getfixturevalue(fixture))
    hits = correct(texts)
    assert sum(hits) >= MIN_FACTS_CORRECT, [(q, t) for (q, _), t, ok in zip(FACTS, texts, hits) if not ok]
    # the linear layers really are packed int4: far smaller than the fp32 model's 538 MB
    assert weight_bytes < 300 * 2**20
