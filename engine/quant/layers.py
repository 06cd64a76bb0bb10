"""One decoder layer at a time: AWQ (scale + clip search, then rounding), GPTQ, or plain round-to-nearest.

Works on the transformers Llama-family layer (Llama, Mistral, Qwen2, Qwen3): ``input_layernorm -> self_attn
(q/k/v_proj, o_proj) -> residual -> post_attention_layernorm -> mlp (gate/up_proj, down_proj) -> residual``.
Linear layers are handled in execution order and each sees inputs computed through the ones before it
(GPTQ's ``true_sequential``); after a layer is done its weights hold their dequantized values, so the
layer's output, fed to the next layer, carries the quantization error forward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.quant.awq import AWQMethod
from engine.quant.awq_search import ScaleGroup, Screen, apply_clip, apply_scales, search_clip, search_scales
from engine.quant.formats import QuantMethod
from engine.quant.gptq import GPTQMethod
from engine.quant.gptq_solver import GPTQConfig, HessianAccumulator, gptq_quantize
from engine.quant.rtn import dequantize_dense, effective_group, quantize_grouped, working

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
O_PROJ = ("self_attn.o_proj",)
GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
DOWN = ("mlp.down_proj",)
LINEARS = QKV + O_PROJ + GATE_UP + DOWN


@dataclass(frozen=True)
class LayerLayout:
    """A decoder layer's linears by role. Phi-3 keeps q/k/v in one ``qkv_proj`` (v in its last rows) and
    gate/up in one ``gate_up_proj`` (up in its last rows); the others keep one module each."""

    qkv: tuple[str, ...]
    gate_up: tuple[str, ...]
    v_producer: str  # the module whose (last) output rows are v, which o_proj reads
    up_producer: str  # the module whose (last) output rows are up, which down_proj reads
    clipped: tuple[str, ...]  # AWQ's clip search: not q/k (their errors meet in q @ k^T, which it cannot see)

    @property
    def linears(self) -> tuple[str, ...]:
        return self.qkv + O_PROJ + self.gate_up + DOWN


SEPARATE = LayerLayout(QKV, GATE_UP, "self_attn.v_proj", "mlp.up_proj",
                       ("self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
FUSED = LayerLayout(("self_attn.qkv_proj",), ("mlp.gate_up_proj",), "self_attn.qkv_proj", "mlp.gate_up_proj",
                    ("self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))


def has_sandwich_norms(layer: nn.Module) -> bool:
    """Gemma 2/3: the attention and MLP outputs are normalised too (post_attention_layernorm normalises the
    attention output; pre_feedforward_layernorm feeds the MLP, post_feedforward_layernorm its output)."""
    return hasattr(layer, "pre_feedforward_layernorm")


def mlp_norm(layer: nn.Module) -> nn.Module:
    """The norm whose output is the MLP's input."""
    return layer.pre_feedforward_layernorm if has_sandwich_norms(layer) else layer.post_attention_layernorm


def norm_offset(norm: nn.Module) -> float:
    """What a norm adds to its weight before scaling: Gemma's norms scale by 1 + weight (weights start at 0)."""
    return 1.0 if type(norm).__name__.startswith("Gemma") else 0.0


def after_attention(layer: nn.Module, hidden: torch.Tensor, attn_out: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the residual stream after the attention block, the MLP's input) from the layer input and o_proj's output."""
    if has_sandwich_norms(layer):
        attn_out = layer.post_attention_layernorm(attn_out)
    mid = hidden + attn_out
    return mid, mlp_norm(layer)(mid)


def after_mlp(layer: nn.Module, mid: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
    """The layer's output from the residual stream after attention and down_proj's output."""
    if has_sandwich_norms(layer):
        mlp_out = layer.post_feedforward_layernorm(mlp_out)
    return mid + mlp_out


def layer_layout(layer: nn.Module) -> LayerLayout:
    """FUSED when the layer has Phi-3's fused projections, SEPARATE otherwise."""
    names = dict(layer.named_modules())
    return FUSED if "self_attn.qkv_proj" in names and "mlp.gate_up_proj" in names else SEPARATE


@dataclass(frozen=True)
class QuantizeOptions:
    """Everything that decides the result. ``n_grid``/``clip``/``duo_scaling`` are AWQ's, ``damp_percent`` GPTQ's.

    ``precision``: the dtype the layers are computed in, "float64" (same bytes on any machine; the default on
    CPU) or "float32" (the default on a GPU, where float64 runs at a small fraction of float32's rate).
    """

    method: str
    group_size: int = 128
    bits: int = 4
    sym: bool = False
    desc_act: bool = False
    damp_percent: float = 0.01
    n_grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    cpu_threads: int | None = None  # None: torch's setting
    precision: str | None = None  # None: float64 on CPU, float32 on GPU

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        precision = self.precision or ("float64" if device.type == "cpu" else "float32")
        return torch.float64 if precision == "float64" else torch.float32

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


def quantize_rtn_layers(layers: nn.ModuleList, layers_prefix: str, opts: QuantizeOptions
                        ) -> dict[str, QuantizedLinear]:
    """Round-to-nearest on AutoAWQ's min/max grid: no calibration, no layer order needed."""
    results = {}
    for i, layer in enumerate(layers):
        modules = dict(layer.named_modules())
        for name in layer_layout(layer).linears:
            codes, scales, zeros = quantize_grouped(modules[name].weight.data, opts.group_size)
            results[f"{layers_prefix}.{i}.{name}"] = QuantizedLinear(codes, scales, zeros)
    return results


def to_cpu(r: QuantizedLinear) -> QuantizedLinear:
    return QuantizedLinear(r.codes.cpu(), r.scales.cpu(), r.zeros.cpu(), None if r.g_idx is None else r.g_idx.cpu())


class _Captured(Exception):
    """Raised by ``capture_input``'s hook: the rest of the forward is not needed."""


def capture_input(module: nn.Module, run: Callable[[], object]) -> torch.Tensor:
    """The input ``module`` receives while ``run()`` executes; ``run()`` is stopped there, so neither ``module``
    nor what follows it is computed (o_proj and down_proj end their blocks: their outputs are not wanted)."""
    captured = []

    def hook(_module: nn.Module, args: tuple) -> None:
        captured.append(args[0])
        raise _Captured

    handle = module.register_forward_pre_hook(hook)
    try:
        run()
    except _Captured:
        pass
    finally:
        handle.remove()
    return captured[0]


def quantize_awq_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict,
                       opts: QuantizeOptions) -> tuple[dict[str, QuantizedLinear], torch.Tensor]:
    """Scale search, clip search, then round-to-nearest, for one decoder layer (AutoAWQ's order)."""
    m = dict(layer.named_modules())
    attn, mlp = layer.self_attn, layer.mlp
    x_attn = layer.input_layernorm(hidden)  # [B, S, hidden]
    o_in = capture_input(m["self_attn.o_proj"], lambda: attn(hidden_states=x_attn, **kwargs))
    _, x_mlp = after_attention(layer, hidden, m["self_attn.o_proj"](o_in))
    down_in = capture_input(m["mlp.down_proj"], lambda: mlp(x_mlp))  # [B, S, intermediate]

    layout = layer_layout(layer)
    groups = {"qkv": ScaleGroup(layer.input_layernorm, [m[n] for n in layout.qkv],
                                lambda x: attn(hidden_states=x, **kwargs)[0], x_attn,
                                prev_offset=norm_offset(layer.input_layernorm))}
    v_width = _v_width(attn, m, layout)
    v_to_o = v_channel_of_o_input(attn, v_width, m["self_attn.o_proj"])
    if v_to_o is not None:
        groups["o"] = ScaleGroup(m[layout.v_producer], [m["self_attn.o_proj"]], m["self_attn.o_proj"], o_in,
                                 None if v_to_o.numel() == v_width else v_to_o)
    groups["gate_up"] = ScaleGroup(mlp_norm(layer), [m[n] for n in layout.gate_up], mlp, x_mlp,
                                   prev_offset=norm_offset(mlp_norm(layer)))
    groups["down"] = ScaleGroup(m[layout.up_producer], [m["mlp.down_proj"]], m["mlp.down_proj"], down_in)
    if hidden.dtype == torch.float64:
        add_float32_screens(layer, kwargs, groups)
    scales = {key: search_scales(g, opts.group_size, opts.n_grid, opts.duo_scaling) for key, g in groups.items()}
    for key, g in groups.items():
        apply_scales(g, scales[key])

    if opts.clip:
        inputs = {"self_attn.v_proj": groups["qkv"].inputs, "self_attn.o_proj": groups["o"].inputs if "o" in groups
                  else o_in, "mlp.gate_proj": groups["gate_up"].inputs, "mlp.up_proj": groups["gate_up"].inputs,
                  "mlp.gate_up_proj": groups["gate_up"].inputs, "mlp.down_proj": groups["down"].inputs}
        for name in layout.clipped:
            apply_clip(m[name], search_clip(m[name].weight.data, inputs[name], opts.group_size))

    results = {}
    for name in layout.linears:
        codes, q_scales, q_zeros = quantize_grouped(m[name].weight.data, opts.group_size)
        results[name] = QuantizedLinear(codes, q_scales, q_zeros)
        m[name].weight.data = dequantize_dense(codes, q_scales, q_zeros,
                                               effective_group(opts.group_size, codes.shape[1]))
    return results, layer(hidden, **kwargs)


def add_float32_screens(layer: nn.Module, kwargs: dict, groups: dict[str, ScaleGroup]) -> None:
    """Give each scale group a float32 twin (awq_search.Screen) computed through a float32 copy of the layer,
    so a float64 build scores its grids at float32 speed and only near-ties in float64."""
    twin = copy.deepcopy(layer).float()
    t = dict(twin.named_modules())
    name_of = {id(module): name for name, module in layer.named_modules()}
    kwargs32 = {key: _to_float32(value) for key, value in kwargs.items()}
    inspects = {"qkv": lambda x: twin.self_attn(hidden_states=x, **kwargs32)[0], "o": t["self_attn.o_proj"],
                "gate_up": twin.mlp, "down": t["mlp.down_proj"]}
    for key, group in groups.items():
        linears = [t[name_of[id(fc)]] for fc in group.linears]  # the twin's copies of the group's linears
        inputs = group.inputs.float()
        gram = None
        if len(group.linears) == 1 and group.inspect is group.linears[0]:
            flat = inputs.reshape(-1, inputs.shape[-1])  # [tokens, in]
            gram = flat.t() @ flat  # [in, in]
        group.screen = Screen(linears, inspects[key], inputs, gram)


def _to_float32(value):
    if torch.is_tensor(value) and value.is_floating_point():
        return value.float()
    if isinstance(value, tuple):
        return tuple(_to_float32(v) for v in value)
    return value


def _v_width(attn: nn.Module, modules: dict[str, nn.Module], layout: LayerLayout) -> int:
    """Output channels of v: v_proj's, or in a fused qkv_proj the kv heads' share of o_proj's input."""
    if layout.v_producer == "self_attn.v_proj":
        return modules["self_attn.v_proj"].out_features
    return modules["self_attn.o_proj"].in_features // int(attn.num_key_value_groups)


def v_channel_of_o_input(attn: nn.Module, v_width: int, o_proj: nn.Linear) -> torch.Tensor | None:
    """For each o_proj input channel, the v channel (of ``v_width``) it carries (None if not a plain head copy).

    Without GQA that is the identity (AutoAWQ's v_proj -> o_proj scaling). With GQA, query head ``h``
    reads kv head ``h // n_rep``, so o_proj channel ``h * head_dim + d`` carries v channel
    ``(h // n_rep) * head_dim + d``; AutoAWQ skips such layers, we tie their scales instead.
    """
    head_dim = getattr(attn, "head_dim", None)
    if not head_dim or o_proj.in_features % head_dim or v_width % head_dim:
        return None
    num_heads, num_kv_heads = o_proj.in_features // head_dim, v_width // head_dim
    if num_heads % num_kv_heads:
        return None
    channel = torch.arange(o_proj.in_features, device=o_proj.weight.device)
    head, dim = channel // head_dim, channel % head_dim
    return (head // (num_heads // num_kv_heads)) * head_dim + dim


def quantize_gptq_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict,
                        opts: QuantizeOptions) -> tuple[dict[str, QuantizedLinear], torch.Tensor]:
    """GPTQ each group of linears on inputs computed through the already-quantized ones."""
    m = dict(layer.named_modules())
    cfg = GPTQConfig(group_size=opts.group_size, sym=opts.sym, desc_act=opts.desc_act,
                     damp_percent=opts.damp_percent, min_zero=0 if opts.sym else 1)
    attn, mlp = layer.self_attn, layer.mlp
    results: dict[str, QuantizedLinear] = {}
    x_attn = layer.input_layernorm(hidden)
    layout = layer_layout(layer)
    results.update(gptq_group(m, layout.qkv, x_attn, cfg))
    o_in = capture_input(m["self_attn.o_proj"], lambda: attn(hidden_states=x_attn, **kwargs))
    results.update(gptq_group(m, O_PROJ, o_in, cfg))
    h_mid, x_mlp = after_attention(layer, hidden, m["self_attn.o_proj"](o_in))
    results.update(gptq_group(m, layout.gate_up, x_mlp, cfg))
    down_in = capture_input(m["mlp.down_proj"], lambda: mlp(x_mlp))
    results.update(gptq_group(m, DOWN, down_in, cfg))
    return results, after_mlp(layer, h_mid, m["mlp.down_proj"](down_in))


def gptq_group(modules: dict[str, nn.Module], names: tuple[str, ...], inputs: torch.Tensor,
               cfg: GPTQConfig) -> dict[str, QuantizedLinear]:
    """Solve the linears sharing ``inputs`` as one stacked matrix; write their dequantized weights back."""
    linears = [modules[n] for n in names]
    acc = HessianAccumulator(linears[0].in_features, inputs.device, working(inputs).dtype)
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
