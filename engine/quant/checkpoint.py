"""Write a quantized model as AutoAWQ (GEMM) or AutoGPTQ (v1) would: safetensors, config.json, tokenizer files.

Tensor names follow the source checkpoint: every quantized ``prefix.weight`` becomes the tool's
``prefix.qweight`` / ``qzeros`` / ``scales`` (/ ``g_idx``), everything else (embeddings, norms, possibly
rescaled by AWQ, biases) is saved as float16 under its own name. The folder is built under a temporary
name beside ``out_dir`` and renamed into place, so a crash never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from engine.quant.awq import awq_tensors
from engine.quant.gptq import gptq_tensors
from engine.quant.layers import QuantizedLinear, QuantizeOptions

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
SKIPPED_FILES = ("config.json", "model.safetensors.index.json", "quantize_config.json", "quant_config.json",
                 ".pagoda-manifest.json")


def write_checkpoint(model: nn.Module, src_dir: Path, out_dir: Path, config: dict,
                     results: dict[str, QuantizedLinear], opts: QuantizeOptions) -> Path:
    """model.safetensors + config.json + tokenizer files into a temporary folder, then renamed into place."""
    from safetensors.torch import save_file

    from engine.bundled import publish

    method = opts.quant_method()
    tensors = _checkpoint_tensors(model, _source_tensor_names(src_dir), results, opts)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        qcfg = method.config_dict()
        new_config = dict(config, quantization_config=qcfg)
        for key in ("dtype", "torch_dtype"):
            if key in new_config or key == "dtype":
                new_config[key] = "float16"
        (tmp_dir / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
        if opts.method == "gptq":  # AutoGPTQ < 0.7 reads this side file
            (tmp_dir / "quantize_config.json").write_text(json.dumps(qcfg, indent=2) + "\n")
        for path in sorted(src_dir.iterdir()):
            if path.is_file() and path.name not in SKIPPED_FILES and not path.name.endswith(WEIGHT_FILES):
                shutil.copy2(path, tmp_dir / path.name)
        return publish(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def _source_tensor_names(src_dir: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for path in sorted(src_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def _checkpoint_tensors(model: nn.Module, names: list[str], results: dict[str, QuantizedLinear],
                        opts: QuantizeOptions) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        if prefix in results and leaf == "weight":
            continue
        value = state[name].detach().cpu()
        tensors[name] = (value.to(torch.float16) if value.is_floating_point() else value).contiguous()
    for prefix, r in results.items():
        if opts.method == "gptq":
            packed = gptq_tensors(r.codes, r.scales, r.zeros, r.g_idx, "gptq")
        else:
            packed = awq_tensors(r.codes, r.scales, r.zeros)
        tensors.update({f"{prefix}.{key}": value for key, value in packed.items()})
    return tensors
