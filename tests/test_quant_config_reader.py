"""One quantization-config reader: config.json's ``quantization_config``, else quantize_config.json (AutoGPTQ) or
quant_config.json (early AutoAWQ). The loader's format choice and the folder check (what the UI and the Hub
download check run) read a checkpoint the same way, side files included."""

from __future__ import annotations

import json
import os

import pytest

from engine.config import read_folder_quantization_config
from engine.hub import SIDE_FILES, inspect_folder
from engine.quant.formats import get_quant_method

AWQ_SIDE = {"w_bit": 4, "q_group_size": 128, "version": "GEMM", "zero_point": True}
GPTQ_SIDE = {"bits": 4, "group_size": 64, "desc_act": False}


@pytest.mark.parametrize(("name", "side", "method"), [("quant_config.json", AWQ_SIDE, "awq"),
                                                      ("quantize_config.json", GPTQ_SIDE, "gptq")])
def test_side_files_are_read_alike_by_loader_and_folder_check(default_model_dir, tmp_path, name, side, method):
    for item in default_model_dir.iterdir():
        if item.is_file():
            os.symlink(item, tmp_path / item.name)
    (tmp_path / name).write_text(json.dumps(side))
    raw = json.loads((tmp_path / "config.json").read_text())
    qcfg = read_folder_quantization_config(tmp_path, raw)
    assert qcfg["quant_method"] == method
    assert type(get_quant_method(tmp_path, raw)).__name__.lower().startswith(method)  # what the loader uses
    label = inspect_folder(tmp_path).quantization
    assert label.startswith(method.upper()) and "4-bit" in label, label  # what the UI / download check report
    assert name in SIDE_FILES  # a Hub download fetches it


def test_config_json_wins_and_unquantized_is_none(default_model_dir, tmp_path):
    raw = json.loads((default_model_dir / "config.json").read_text())
    assert read_folder_quantization_config(default_model_dir, raw) is None
    (tmp_path / "quant_config.json").write_text(json.dumps(AWQ_SIDE))
    inline = {**raw, "quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": 128}}
    assert read_folder_quantization_config(tmp_path, inline)["bits"] == 8
