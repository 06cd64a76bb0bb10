"""Issue 2: the default model, the Llama model code against HF transformers, the offline LLM API, the catalog."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.bundled import is_complete
from engine.catalog import Catalog
from engine.errors import EngineError

REPO = Path(__file__).resolve().parent.parent

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "The chemical symbol for gold is",
    "Translate to French: I like cheese.",
    "Q: What is the largest planet in the solar system?\nA:",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Les montagnes de Suisse sont",
    "import numpy as np\nx = np.arange(10)\nprint(",
]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    from engine import LLM

    return LLM(str(default_model_dir), dtype="float32", device="cpu", kv_cache_memory="256MiB")


@pytest.fixture(scope="module")
def hf_model(fp16_reference):
    """The default model in transformers, float32 (conftest's copy, loaded once for every module that uses it)."""
    return fp16_reference


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=2)
    return out[0, len(prompt_ids):].tolist()


def test_greedy_matches_transformers(llm, hf_model):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    outputs = llm.generate(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs):
        expected = hf_greedy(hf_model, output.prompt_token_ids, 20)
        assert output.outputs[0].token_ids == expected, prompt
    assert all(o.outputs[0].text for o in outputs)


def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=40))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason in ("stop", "length")


def test_generate_accepts_token_ids_and_reports_prompt(llm):
    ids = llm.tokenizer.encode("Hello there")
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert out.prompt_token_ids == ids
    assert len(out.outputs[0].token_ids) == 4
    assert out.outputs[0].finish_reason == "length"


def test_prompt_longer_than_context_is_a_clear_error(default_model_dir):
    from engine import LLM

    small = LLM(str(default_model_dir), dtype="float32", device="cpu", max_model_len=64, kv_cache_memory="16MiB")
    with pytest.raises(EngineError, match="context"):
        small.generate("word " * 200, SamplingParams(max_tokens=4))
    # the engine still serves after the rejection
    assert small.generate("Hi", SamplingParams(temperature=0.0, max_tokens=2))[0].outputs[0].token_ids


def test_fetch_is_cached_and_prints_path(default_model_dir):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "app.py", "fetch", "smollm2-135m-instruct"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(default_model_dir)
    assert time.monotonic() - start < 30  # no download or conversion on the second call
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (default_model_dir / name).is_file()


def test_corrupt_cache_is_detected(default_model_dir, tmp_path):
    broken = tmp_path / "model"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", ".pagoda-manifest.json"):
        (broken / name).write_bytes((default_model_dir / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"truncated")
    assert is_complete(default_model_dir)
    assert not is_complete(broken)
    (broken / ".pagoda-manifest.json").unlink()
    assert not is_complete(broken)


def test_catalog_schema_and_entries(tmp_path):
    catalog = Catalog.load()
    ids = {e.id for e in catalog}
    assert {"smollm2-135m-instruct", "qwen2.5-7b-instruct-awq", "llama-3.1-8b-instruct-awq"} <= ids
    assert all(e.repo for e in catalog if e.source == "hub")
    bad = tmp_path / "models.yaml"
    bad.write_text("models:\n  - id: x\n    name: X\n    source: ftp\n    quantization: fp16\n"
                   "    size_gb: 1\n    context: 10\n")
    with pytest.raises(EngineError, match="source"):
        Catalog.load(bad)
    bad.write_text("models:\n  - id: x\n    name: X\n")
    with pytest.raises(EngineError, match="missing 'source'"):
        Catalog.load(bad)


def test_unsupported_architecture_is_refused(tmp_path, default_model_dir):
    from engine import LLM

    cfg = json.loads((default_model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineError, match="unsupported architecture"):
        LLM(str(tmp_path), device="cpu")
