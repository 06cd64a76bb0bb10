"""Our own 4-bit quantizer: AWQ, GPTQ or round-to-nearest over a transformers model, written as a Hub checkpoint.

The model is processed one decoder layer at a time, as AutoAWQ and GPTQ do: the calibration activations
entering layer ``i`` are the outputs of layers ``0..i-1`` *after* they were quantized, so each layer
compensates for what the earlier ones lost. Inside a layer the linear layers are quantized in execution
order (q/k/v, o, gate/up, down; GPTQ's ``true_sequential``) and each group sees inputs computed through the
already-quantized ones. Only the layer being worked on is moved to ``device``.

The output is what AutoAWQ (GEMM) or AutoGPTQ (v1 zero-points) would have written: ``model.safetensors``
with their tensor names, dtypes and shapes, ``config.json`` with the matching ``quantization_config``, and
every tokenizer / chat template / generation config file of the source, so that Pagoda, vLLM or
transformers can load it. RTN (the baseline) is written in the AWQ layout.

The same inputs give the same bytes on any machine: calibration uses consecutive windows of a fixed text
(nothing is sampled), and on CPU the whole model is computed in float64, so that which scale, clip, code or
column order wins does not hinge on summation order (thread count, SIMD width, BLAS build). In float32 those
near-ties flipped between machines and the builds, and their answers, differed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from engine.errors import EngineError
from engine.quant.checkpoint import write_checkpoint
from engine.quant.formats import get_quant_method
from engine.quant.layers import (
    QuantizedLinear,
    QuantizeOptions,
    layer_layout,
    quantize_awq_layer,
    quantize_gptq_layer,
    quantize_rtn_layers,
    to_cpu,
)
from engine.quant.rtn import check_group_size

METHODS = ("awq", "gptq", "rtn")
# Their decoder layers share the module names of engine/quant/layers.py (Qwen3's and Gemma 3's q/k norms sit
# inside self_attn after q/k_proj, so scales folded into input_layernorm stay exact); Phi-3 (Phi-3.5, Phi-4
# mini) has fused qkv_proj and gate_up_proj, whose v and up rows come last (layers.FUSED); Gemma 3 normalises
# the attention and MLP outputs too, feeds its MLP from pre_feedforward_layernorm and scales by 1 + weight
# (layers.after_attention, norm_offset), and its sliding and global layers get different rotary tables.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "Gemma3ForCausalLM")
DEFAULT_CALIBRATION = Path(__file__).resolve().parents[2] / "data" / "calibration.txt"

Log = Callable[[str], None]


def quantize_model(src_dir: Path | str, out_dir: Path | str, method: str, group_size: int = 128, bits: int = 4,
                   desc_act: bool = False, sym: bool = False, calibration_path: Path | str | None = None,
                   num_samples: int = 16, seq_len: int = 256, device: str | torch.device | None = None,
                   log: Log = print, **options) -> Path:
    """Quantize the fp16/bf16/fp32 model in ``src_dir`` and write a Hub-compatible checkpoint to ``out_dir``.

    ``method``: 'awq' (AutoAWQ GEMM output), 'gptq' (AutoGPTQ v1 output; ``desc_act`` and ``sym`` apply) or
    'rtn' (plain round-to-nearest, AWQ layout). Calibration uses ``num_samples`` windows of ``seq_len``
    tokens of ``calibration_path`` (default: data/calibration.txt). Extra keyword ``options`` go to
    ``QuantizeOptions`` (n_grid, clip, duo_scaling, damp_percent, cpu_threads, precision). Returns ``out_dir``.
    """
    opts = _validate_options(method, group_size, bits, sym, desc_act, options)
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    if out_dir.resolve() == src_dir.resolve():
        raise EngineError("the output folder must differ from the source model folder", param="out_dir")
    config = _read_source_config(src_dir)
    _check_group_size_against_config(config, opts.group_size)
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    with _cpu_threads(opts.cpu_threads if dev.type == "cpu" else None):
        model, tokenizer = _load_model(src_dir, opts.compute_dtype(dev))
        layers, layers_prefix = _decoder_layers(model)
        _check_shapes(layers, opts.group_size)
        log(f"quantizing {src_dir.name} with {opts.method} (group_size {opts.group_size}, {len(layers)} layers) "
            f"on {dev} in {str(opts.compute_dtype(dev)).removeprefix('torch.')}")
        if opts.method == "rtn":
            results = quantize_rtn_layers(layers, layers_prefix, opts)
        else:
            ids = calibration_batch(tokenizer, calibration_path, num_samples, seq_len, log)
            results = _quantize_sequential(model, layers, layers_prefix, ids, opts, dev, log)
        target = write_checkpoint(model, src_dir, out_dir, config, results, opts)
    log(f"wrote {target} in {time.perf_counter() - started:.1f}s")
    return target


@contextmanager
def _cpu_threads(threads: int | None) -> Iterator[None]:
    """Run with ``threads`` intra-op threads (None: leave torch's setting), restoring it afterwards.

    On an idle 2-core box two threads run an AWQ layer in 2.3 s and one thread in 4.2 s, but when other
    processes keep the cores busy, OpenMP hand-offs stall: a whole AWQ run then took 378 s with two
    threads and 85 s with one. ``cpu_threads=1`` is the cure on a shared machine.
    """
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _validate_options(method: str, group_size: int, bits: int, sym: bool, desc_act: bool,
                      options: dict) -> QuantizeOptions:
    if method not in METHODS:
        raise EngineError(f"unknown quantization method {method!r}: choose one of {', '.join(METHODS)}",
                          param="method")
    if bits != 4:
        raise EngineError(f"only 4-bit quantization is supported, got bits={bits}", param="bits")
    if group_size != -1 and group_size <= 0:
        raise EngineError(f"group_size must be positive or -1, got {group_size}", param="group_size")
    if method != "gptq" and (sym or desc_act):
        raise EngineError(f"sym and desc_act are GPTQ options; {method} writes zero-point AWQ GEMM weights",
                          param="sym" if sym else "desc_act")
    unknown = set(options) - {"damp_percent", "n_grid", "duo_scaling", "clip", "cpu_threads", "precision"}
    if unknown:
        raise EngineError(f"unknown quantizer option(s): {', '.join(sorted(unknown))}", param=min(unknown))
    if options.get("precision") not in (None, "float32", "float64"):
        raise EngineError(f"precision must be float32 or float64, got {options['precision']!r}", param="precision")
    return QuantizeOptions(method, group_size, bits, sym, desc_act, **options)


def _read_source_config(src_dir: Path) -> dict:
    path = src_dir / "config.json"
    if not path.is_file():
        raise EngineError(f"{src_dir} is not a model folder: config.json is missing", param="model")
    config = json.loads(path.read_text())
    if get_quant_method(src_dir, config) is not None:
        raise EngineError(f"{src_dir} is already quantized; quantize the fp16/bf16 model", param="model")
    archs = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise EngineError(f"the quantizer supports {', '.join(SUPPORTED_ARCHITECTURES)}, not {archs}",
                          param="model")
    return config


def _check_group_size_against_config(config: dict, group_size: int) -> None:
    """Refuse a group size that does not divide every linear input size, before loading anything."""
    hidden = int(config.get("hidden_size", 0))
    heads = int(config.get("num_attention_heads", 0))
    head_dim = int(config.get("head_dim") or (hidden // heads if heads else 0))
    for name, size in (("hidden_size", hidden), ("intermediate_size", int(config.get("intermediate_size", 0))),
                       ("num_attention_heads * head_dim", heads * head_dim)):
        if size and group_size != -1 and size % group_size:
            raise EngineError(f"group_size {group_size} does not divide the model's {name} {size}: AWQ and "
                              f"Pagoda's kernels need whole groups; choose a divisor such as "
                              f"{_largest_divisor(size)} (or -1 for one group per row)", param="group_size")


def _largest_divisor(size: int) -> int:
    return next(g for g in (128, 64, 32, 16, 8) if size % g == 0) if size % 8 == 0 else -1


def _load_model(src_dir: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    return model, AutoTokenizer.from_pretrained(src_dir)


def _decoder_layers(model: nn.Module) -> tuple[nn.ModuleList, str]:
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList):
            return module, name
    raise EngineError("could not find the decoder layers of the model", param="model")


def _check_shapes(layers: nn.ModuleList, group_size: int) -> None:
    """Fail before any work when a group size does not divide a layer's input size (AWQ and our kernels need it)."""
    modules = dict(layers[0].named_modules())
    for name in layer_layout(layers[0]).linears:
        linear = modules[name]
        check_group_size(group_size, linear.in_features)
        if linear.out_features % 8 or linear.in_features % 8:
            raise EngineError(f"{name} has shape [{linear.out_features}, {linear.in_features}]; 4-bit packing "
                              f"needs both sizes to be multiples of 8", param="model")


def calibration_batch(tokenizer, calibration_path: Path | str | None, num_samples: int, seq_len: int,
                      log: Log = print) -> torch.Tensor:
    """Consecutive ``seq_len``-token windows of the calibration text: [num_samples, seq_len] token ids."""
    path = Path(calibration_path) if calibration_path is not None else DEFAULT_CALIBRATION
    if not path.is_file():
        raise EngineError(f"calibration text {path} not found; pass calibration_path", param="calibration_path")
    ids = tokenizer(path.read_text(), add_special_tokens=False).input_ids
    available = len(ids) // seq_len
    if available < 1:
        raise EngineError(f"calibration text {path} has {len(ids)} tokens, fewer than seq_len {seq_len}",
                          param="calibration_path")
    if available < num_samples:
        log(f"calibration text has {len(ids)} tokens: using {available} samples of {seq_len} instead of "
            f"{num_samples}")
    count = min(num_samples, available)
    return torch.tensor(ids[: count * seq_len]).reshape(count, seq_len)


class _StopForward(Exception):
    pass


@torch.no_grad()
def _layer_inputs(model: nn.Module, layers: nn.ModuleList, ids: torch.Tensor,
                  device: torch.device) -> tuple[torch.Tensor, list[dict]]:
    """The hidden states the model passes to its first layer and the keyword arguments (rotary cos/sin, mask)
    it passes to each layer: Gemma 3's sliding and global layers get different ones. The layers are stubbed
    out meanwhile (the arguments do not depend on their outputs), so nothing but the embedding runs."""
    captured: dict = {"kwargs": []}

    def stub(index: int):
        def forward(*args, **kwargs):
            hidden = args[0] if args else kwargs.pop("hidden_states")
            captured.setdefault("hidden", hidden)
            captured["kwargs"].append(kwargs)
            if index == len(layers) - 1:
                raise _StopForward
            return hidden
        return forward

    base = model.get_decoder()
    embed, rotary = base.embed_tokens, getattr(base, "rotary_emb", None)
    embed.to(device)
    if rotary is not None:
        rotary.to(device)
    for i, layer in enumerate(layers):
        layer.forward = stub(i)
    try:
        base(input_ids=ids.to(device), use_cache=False)
    except _StopForward:
        pass
    finally:
        for layer in layers:
            del layer.forward  # the class's forward again
        embed.to("cpu")
    return captured["hidden"], captured["kwargs"]


def _quantize_sequential(model: nn.Module, layers: nn.ModuleList, layers_prefix: str, ids: torch.Tensor,
                         opts: QuantizeOptions, device: torch.device, log: Log) -> dict[str, QuantizedLinear]:
    hidden, layer_kwargs = _layer_inputs(model, layers, ids, device)  # hidden [num_samples, seq_len, hidden]
    results: dict[str, QuantizedLinear] = {}
    quantize_layer = quantize_awq_layer if opts.method == "awq" else quantize_gptq_layer
    for i, layer in enumerate(layers):
        started = time.perf_counter()
        layer.to(device)
        with torch.no_grad():
            layer_results, hidden = quantize_layer(layer, hidden, layer_kwargs[i], opts)
        layer.to("cpu")
        results.update({f"{layers_prefix}.{i}.{name}": to_cpu(r) for name, r in layer_results.items()})
        log(f"[{opts.method}] layer {i + 1}/{len(layers)} quantized in {time.perf_counter() - started:.1f}s")
    return results


# Bundled builds run on the CPU in float64 with a pinned thread count, whatever the machine offers.
BUNDLED_COMMON = {"device": "cpu", "precision": "float64", "cpu_threads": 2}
BUNDLED_SETTINGS = {
    # 32 divides SmolLM2's 576 and 1536 (128 does not divide 576); g64 lost 12-16% perplexity, g32 7-9%.
    "awq": {"group_size": 32, "num_samples": 8, "seq_len": 256, **BUNDLED_COMMON},
    # Act-order was worth 8 points of perplexity at g32 on this model (26.6 -> 24.6 on data/heldout.txt).
    "gptq": {"group_size": 32, "num_samples": 16, "seq_len": 256, "desc_act": True, **BUNDLED_COMMON},
}


def build_bundled_quantized(base_dir: Path, out_dir: Path, method: str, log: Log = print) -> Path:
    """Build the catalog's ``smollm2-135m-instruct-awq`` / ``-gptq`` from the fp16 default model in ``base_dir``.

    Uses the bundled calibration text (data/calibration.txt); a few minutes on a 2-core CPU.
    """
    if method not in BUNDLED_SETTINGS:
        raise EngineError(f"bundled quantized models are awq or gptq, not {method!r}", param="method")
    return quantize_model(base_dir, out_dir, method, log=log, **BUNDLED_SETTINGS[method])


# Builds of a Hub base run where the engine runs (a GPU: float32, minutes for a few billion parameters; the
# bytes may differ between machines, unlike the bundled builds) with AutoAWQ's usual group size.
FROM_HUB_SETTINGS = {"num_samples": 32, "seq_len": 512}


def build_from_hub_base(base_dir: Path, out_dir: Path, method: str, group_size: int = 128,
                        log: Log = print) -> Path:
    """Quantize a downloaded Hub model (a catalog build entry such as ``phi-4-mini-instruct-awq``) on the
    default device, calibrated on the bundled text (data/calibration.txt)."""
    if method not in ("awq", "gptq"):
        raise EngineError(f"catalog builds are awq or gptq, not {method!r}", param="method")
    return quantize_model(base_dir, out_dir, method, group_size=group_size, log=log, **FROM_HUB_SETTINGS)

