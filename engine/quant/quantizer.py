"""Our own 4-bit quantizer: AWQ, GPTQ or round-to-nearest over a transformers model, written as a Hub checkpoint.

The model is processed one decoder layer at a time, as AutoAWQ and GPTQ do: the calibration activations
entering layer ``i`` are the outputs of layers ``0..i-1`` *after* they were quantized, so each layer
compensates for what the earlier ones lost. Inside a layer the linear layers are quantized in execution
order (q/k/v, o, gate/up, down; GPTQ's ``true_sequential``) and each group sees inputs computed through the
already-quantized ones. Only the layer being worked on is moved to ``device`` (and to float32).

The output is what AutoAWQ (GEMM) or AutoGPTQ (v1 zero-points) would have written: ``model.safetensors``
with their tensor names, dtypes and shapes, ``config.json`` with the matching ``quantization_config``, and
every tokenizer / chat template / generation config file of the source, so that Pagoda, vLLM or
transformers can load it. RTN (the baseline) is written in the AWQ layout.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from engine.quant.awq import AWQMethod, awq_tensors
from engine.quant.awq_search import ScaleGroup, apply_clip, apply_scales, search_clip, search_scales
from engine.quant.formats import QuantMethod, get_quant_method
from engine.quant.gptq import GPTQMethod, gptq_tensors
from engine.quant.gptq_solver import GPTQConfig, HessianAccumulator, gptq_quantize
from engine.quant.rtn import check_group_size, dequantize_dense, effective_group, quantize_grouped
from engine.request import EngineError

METHODS = ("awq", "gptq", "rtn")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
O_PROJ = ("self_attn.o_proj",)
GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
DOWN = ("mlp.down_proj",)
LINEARS = QKV + O_PROJ + GATE_UP + DOWN
DEFAULT_CALIBRATION = Path(__file__).resolve().parents[2] / "data" / "calibration.txt"
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
SKIPPED_FILES = ("config.json", "model.safetensors.index.json", "quantize_config.json", "quant_config.json",
                 ".pagoda-manifest.json")

Log = Callable[[str], None]


@dataclass(frozen=True)
class QuantizeOptions:
    """Everything that decides the result. ``n_grid``/``clip``/``duo_scaling`` are AWQ's, ``damp_percent`` GPTQ's."""

    method: str
    group_size: int = 128
    bits: int = 4
    sym: bool = False
    desc_act: bool = False
    damp_percent: float = 0.01
    n_grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    cpu_threads: int = 1

    def quant_method(self) -> QuantMethod:
        if self.method == "gptq":
            extra = {"true_sequential": True, "damp_percent": self.damp_percent, "static_groups": False}
            return GPTQMethod(self.bits, self.group_size, "gptq", self.desc_act, self.sym, extra=extra)
        return AWQMethod(self.bits, self.group_size)


@dataclass
class QuantizedLinear:
    """One layer's result: codes [out, in]; scales, zeros [n_groups, out]; g_idx [in] (GPTQ only)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor | None = None


def quantize_model(src_dir: Path | str, out_dir: Path | str, method: str, group_size: int = 128, bits: int = 4,
                   desc_act: bool = False, sym: bool = False, calibration_path: Path | str | None = None,
                   num_samples: int = 16, seq_len: int = 256, device: str | torch.device | None = None,
                   log: Log = print, **options) -> Path:
    """Quantize the fp16/bf16/fp32 model in ``src_dir`` and write a Hub-compatible checkpoint to ``out_dir``.

    ``method``: 'awq' (AutoAWQ GEMM output), 'gptq' (AutoGPTQ v1 output; ``desc_act`` and ``sym`` apply) or
    'rtn' (plain round-to-nearest, AWQ layout). Calibration uses ``num_samples`` windows of ``seq_len``
    tokens of ``calibration_path`` (default: data/calibration.txt). Extra keyword ``options`` go to
    ``QuantizeOptions`` (n_grid, clip, duo_scaling, damp_percent, cpu_threads). Returns ``out_dir``.
    """
    opts = _validate_options(method, group_size, bits, sym, desc_act, options)
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    config = _read_source_config(src_dir)
    _check_group_size_against_config(config, opts.group_size)
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    with _cpu_threads(opts.cpu_threads if dev.type == "cpu" else None):
        model, tokenizer = _load_model(src_dir)
        layers, layers_prefix = _decoder_layers(model)
        _check_shapes(layers, opts.group_size)
        log(f"quantizing {src_dir.name} with {opts.method} (group_size {opts.group_size}, {len(layers)} layers) "
            f"on {dev}")
        if opts.method == "rtn":
            results = _quantize_rtn(layers, layers_prefix, opts)
        else:
            ids = calibration_batch(tokenizer, calibration_path, num_samples, seq_len, log)
            results = _quantize_sequential(model, layers, layers_prefix, ids, opts, dev, log)
        target = _write_checkpoint(model, src_dir, out_dir, config, results, opts)
    log(f"wrote {target} in {time.perf_counter() - started:.1f}s")
    return target


@contextmanager
def _cpu_threads(threads: int | None) -> Iterator[None]:
    """Run with ``threads`` intra-op threads (None: leave torch's setting), restoring it afterwards.

    The quantizer's CPU work is many medium-sized ops; on the 2-core CI box with other work running,
    one thread quantized the default model with AWQ in 85 s and two threads took 378 s (OpenMP hand-offs
    stall when a core is busy elsewhere). ``cpu_threads`` raises it on machines with cores to spare.
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
    unknown = set(options) - {"damp_percent", "n_grid", "duo_scaling", "clip", "cpu_threads"}
    if unknown:
        raise EngineError(f"unknown quantizer option(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
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


def _load_model(src_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32, attn_implementation="sdpa")
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
    for name in LINEARS:
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


def _quantize_rtn(layers: nn.ModuleList, layers_prefix: str, opts: QuantizeOptions) -> dict[str, QuantizedLinear]:
    results = {}
    for i, layer in enumerate(layers):
        modules = dict(layer.named_modules())
        for name in LINEARS:
            codes, scales, zeros = quantize_grouped(modules[name].weight.data, opts.group_size)
            results[f"{layers_prefix}.{i}.{name}"] = QuantizedLinear(codes, scales, zeros)
    return results


class _StopForward(Exception):
    pass


@torch.no_grad()
def _layer0_inputs(model: nn.Module, layers: nn.ModuleList, ids: torch.Tensor,
                   device: torch.device) -> tuple[torch.Tensor, dict]:
    """Hidden states and keyword arguments (rotary cos/sin, mask) that the model passes to its first layer."""
    captured: dict = {}

    def catch(module, args, kwargs):
        captured["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        captured["kwargs"] = kwargs
        raise _StopForward

    base = model.get_decoder()
    embed, rotary = base.embed_tokens, getattr(base, "rotary_emb", None)
    embed.to(device)
    if rotary is not None:
        rotary.to(device)
    handle = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        base(input_ids=ids.to(device), use_cache=False)
    except _StopForward:
        pass
    finally:
        handle.remove()
        embed.to("cpu")
    return captured["hidden"], captured["kwargs"]


def _quantize_sequential(model: nn.Module, layers: nn.ModuleList, layers_prefix: str, ids: torch.Tensor,
                         opts: QuantizeOptions, device: torch.device, log: Log) -> dict[str, QuantizedLinear]:
    hidden, kwargs = _layer0_inputs(model, layers, ids, device)  # [num_samples, seq_len, hidden]
    results: dict[str, QuantizedLinear] = {}
    quantize_layer = _awq_layer if opts.method == "awq" else _gptq_layer
    for i, layer in enumerate(layers):
        started = time.perf_counter()
        layer.to(device)
        with torch.no_grad():
            layer_results, hidden = quantize_layer(layer, hidden, kwargs, opts)
        layer.to("cpu")
        results.update({f"{layers_prefix}.{i}.{name}": _cpu(r) for name, r in layer_results.items()})
        log(f"[{opts.method}] layer {i + 1}/{len(layers)} quantized in {time.perf_counter() - started:.1f}s")
    return results


def _cpu(r: QuantizedLinear) -> QuantizedLinear:
    return QuantizedLinear(r.codes.cpu(), r.scales.cpu(), r.zeros.cpu(), None if r.g_idx is None else r.g_idx.cpu())


def _capture_input(module: nn.Module, run: Callable[[], object]) -> torch.Tensor:
    """The input ``module`` receives while ``run()`` executes."""
    captured = []
    handle = module.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    try:
        run()
    finally:
        handle.remove()
    return captured[0]


def _awq_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict,
               opts: QuantizeOptions) -> tuple[dict[str, QuantizedLinear], torch.Tensor]:
    """Scale search, clip search, then round-to-nearest, for one decoder layer (AutoAWQ's order)."""
    m = dict(layer.named_modules())
    attn, mlp = layer.self_attn, layer.mlp
    x_attn = layer.input_layernorm(hidden)  # [B, S, hidden]
    o_in = _capture_input(m["self_attn.o_proj"], lambda: attn(hidden_states=x_attn, **kwargs))
    x_mlp = layer.post_attention_layernorm(hidden + m["self_attn.o_proj"](o_in))
    down_in = _capture_input(m["mlp.down_proj"], lambda: mlp(x_mlp))  # [B, S, intermediate]

    groups = {"qkv": ScaleGroup(layer.input_layernorm, [m[n] for n in QKV],
                                lambda x: attn(hidden_states=x, **kwargs)[0], x_attn)}
    v_to_o = _v_channel_of_o_input(attn, m["self_attn.v_proj"], m["self_attn.o_proj"])
    if v_to_o is not None:
        groups["o"] = ScaleGroup(m["self_attn.v_proj"], [m["self_attn.o_proj"]], m["self_attn.o_proj"], o_in,
                                 None if v_to_o.numel() == m["self_attn.v_proj"].out_features else v_to_o)
    groups["gate_up"] = ScaleGroup(layer.post_attention_layernorm, [m[n] for n in GATE_UP], mlp, x_mlp)
    groups["down"] = ScaleGroup(m["mlp.up_proj"], [m["mlp.down_proj"]], m["mlp.down_proj"], down_in)
    scales = {key: search_scales(g, opts.group_size, opts.n_grid, opts.duo_scaling) for key, g in groups.items()}
    for key, g in groups.items():
        apply_scales(g, scales[key])

    if opts.clip:
        inputs = {"self_attn.v_proj": groups["qkv"].inputs, "self_attn.o_proj": groups["o"].inputs if "o" in groups
                  else o_in, "mlp.gate_proj": groups["gate_up"].inputs, "mlp.up_proj": groups["gate_up"].inputs,
                  "mlp.down_proj": groups["down"].inputs}
        for name, x in inputs.items():  # not q/k: their errors meet in q @ k^T, which a per-layer error misses
            apply_clip(m[name], search_clip(m[name].weight.data, x, opts.group_size))

    results = {}
    for name in LINEARS:
        codes, q_scales, q_zeros = quantize_grouped(m[name].weight.data, opts.group_size)
        results[name] = QuantizedLinear(codes, q_scales, q_zeros)
        m[name].weight.data = dequantize_dense(codes, q_scales, q_zeros,
                                               effective_group(opts.group_size, codes.shape[1]))
    return results, layer(hidden, **kwargs)


def _v_channel_of_o_input(attn: nn.Module, v_proj: nn.Linear, o_proj: nn.Linear) -> torch.Tensor | None:
    """For each o_proj input channel, the v_proj output channel it carries (None if not a plain head copy).

    Without GQA that is the identity (AutoAWQ's v_proj -> o_proj scaling). With GQA, query head ``h``
    reads kv head ``h // n_rep``, so o_proj channel ``h * head_dim + d`` carries v channel
    ``(h // n_rep) * head_dim + d``; AutoAWQ skips such layers, we tie their scales instead.
    """
    head_dim = getattr(attn, "head_dim", None)
    if not head_dim or o_proj.in_features % head_dim or v_proj.out_features % head_dim:
        return None
    num_heads, num_kv_heads = o_proj.in_features // head_dim, v_proj.out_features // head_dim
    if num_heads % num_kv_heads:
        return None
    channel = torch.arange(o_proj.in_features, device=o_proj.weight.device)
    head, dim = channel // head_dim, channel % head_dim
    return (head // (num_heads // num_kv_heads)) * head_dim + dim


def _gptq_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict,
                opts: QuantizeOptions) -> tuple[dict[str, QuantizedLinear], torch.Tensor]:
    """GPTQ each group of linears on inputs computed through the already-quantized ones."""
    m = dict(layer.named_modules())
    cfg = GPTQConfig(group_size=opts.group_size, sym=opts.sym, desc_act=opts.desc_act,
                     damp_percent=opts.damp_percent, min_zero=0 if opts.sym else 1)
    attn, mlp = layer.self_attn, layer.mlp
    results: dict[str, QuantizedLinear] = {}
    x_attn = layer.input_layernorm(hidden)
    results.update(_gptq_group(m, QKV, x_attn, cfg))
    o_in = _capture_input(m["self_attn.o_proj"], lambda: attn(hidden_states=x_attn, **kwargs))
    results.update(_gptq_group(m, O_PROJ, o_in, cfg))
    h_mid = hidden + m["self_attn.o_proj"](o_in)
    x_mlp = layer.post_attention_layernorm(h_mid)
    results.update(_gptq_group(m, GATE_UP, x_mlp, cfg))
    down_in = _capture_input(m["mlp.down_proj"], lambda: mlp(x_mlp))
    results.update(_gptq_group(m, DOWN, down_in, cfg))
    return results, h_mid + m["mlp.down_proj"](down_in)


def _gptq_group(modules: dict[str, nn.Module], names: tuple[str, ...], inputs: torch.Tensor,
                cfg: GPTQConfig) -> dict[str, QuantizedLinear]:
    """Solve the linears sharing ``inputs`` as one stacked matrix; write their dequantized weights back."""
    linears = [modules[n] for n in names]
    acc = HessianAccumulator(linears[0].in_features, inputs.device)
    acc.add(inputs)
    result = gptq_quantize(torch.cat([fc.weight.data for fc in linears]), acc.hessian, cfg)
    dense = result.dequantize()  # [sum(out), in]
    out, start = {}, 0
    for name, fc in zip(names, linears):
        rows = slice(start, start + fc.out_features)
        fc.weight.data = dense[rows].to(fc.weight.dtype)
        out[name] = QuantizedLinear(result.codes[rows], result.scales[:, rows], result.zeros[:, rows], result.g_idx)
        start += fc.out_features
    return out


def _write_checkpoint(model: nn.Module, src_dir: Path, out_dir: Path, config: dict,
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


BUNDLED_SETTINGS = {"group_size": 32, "num_samples": 16, "seq_len": 256}


def build_bundled_quantized(base_dir: Path, out_dir: Path, method: str, log: Log = print) -> Path:
    """Build the catalog's ``smollm2-135m-instruct-awq`` / ``-gptq`` from the fp16 default model.

    Group size 32 (576 = 18 x 32 and 1536 = 48 x 32; 128 does not divide 576) and the bundled calibration text.
    """
    if method not in ("awq", "gptq"):
        raise EngineError(f"bundled quantized models are awq or gptq, not {method!r}", param="method")
    return quantize_model(base_dir, out_dir, method, log=log, **BUNDLED_SETTINGS)
