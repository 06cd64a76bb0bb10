"""AWQ / GPTQ checkpoint loading: bit-exact against the ecosystem's own packers, and clear errors for bad checkpoints.

The packers below are transcriptions of AutoAWQ's ``WQLinear_GEMM.from_linear`` and AutoGPTQ's
``QuantLinear.pack`` (per-column loops, ``order_map = [0, 2, 4, 6, 1, 3, 5, 7]``, numpy uint32 ors, v1's
``zeros -= 1``), written here independently of Pagoda's code. Each case starts from codes, zero-points
and fp16 scales chosen by the test, builds the float weight those tools would be handed, packs it their
way, and checks that Pagoda's loader yields exactly ``(code - zero) * scale`` (torch.equal).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.errors import EngineError
from engine.quant import get_quant_method
from kernels.reference import dequantize_int4, w4a16_matmul

IN_FEATURES, OUT_FEATURES = 256, 64
PREFIX = "model.layers.3.mlp.down_proj"


# ---------------------------------------------------------------- reference packers (re-derived, not imported)

def autoawq_from_linear(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> dict:
    """AutoAWQ WQLinear_GEMM.from_linear. weight [out, in]; scales, zeros [in // G, out] (after its ``.t()``)."""
    in_features = weight.shape[1]
    scale_zeros = zeros * scales
    scales16 = scales.clone().half()
    intweight = []
    for idx in range(in_features):
        intweight.append(torch.round((weight[:, idx] + scale_zeros[idx // group_size])
                                     / scales16[idx // group_size]).to(torch.int)[:, None])
    intweight = torch.cat(intweight, dim=1).t().contiguous().to(torch.int32)  # [in, out]
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    qweight = torch.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=torch.int32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)
    zeros = zeros.to(torch.int32)
    qzeros = torch.zeros((zeros.shape[0], zeros.shape[1] // 8), dtype=torch.int32)
    for col in range(zeros.shape[1] // 8):
        for i in range(8):
            qzeros[:, col] |= zeros[:, col * 8 + order_map[i]] << (i * 4)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales16}


def autogptq_pack(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
                  v1: bool) -> dict:
    """AutoGPTQ QuantLinear.pack (with g_idx). weight [out, in]; scales, zeros [out, n_groups] as its quantizer
    hands them over. v1 stores ``zeros - 1`` (AutoGPTQ); v2 the zeros themselves (GPTQModel's internal format)."""
    scales = scales.t().contiguous()
    zeros = zeros.t().contiguous()
    scale_zeros = zeros * scales
    scales16 = scales.clone().half()
    intweight = []
    for idx in range(weight.shape[1]):
        g = int(g_idx[idx])
        intweight.append(torch.round((weight[:, idx] + scale_zeros[g]) / scales16[g]).to(torch.int)[:, None])
    intweight = torch.cat(intweight, dim=1).t().contiguous().numpy().astype(np.uint32)  # [in, out]
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= intweight[j] << np.uint32(4 * (j - i))
        i += 8
        row += 1
    if v1:
        zeros = zeros - 1
    zeros = zeros.numpy().astype(np.int64).astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 8), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 8):
            qzeros[:, col] |= zeros[:, j] << np.uint32(4 * (j - i))
        i += 8
        col += 1
    return {"qweight": torch.from_numpy(qweight.astype(np.int32)), "qzeros": torch.from_numpy(qzeros.astype(np.int32)),
            "scales": scales16, "g_idx": g_idx.to(torch.int32)}


# ---------------------------------------------------------------- test data: codes -> float weight

def random_quantized(group_size: int, sym: bool, min_zero: int, seed: int, in_features: int = IN_FEATURES):
    """codes [out, in], zeros and fp16-exact scales [n_groups, out], and the float weight they stand for."""
    gen = torch.Generator().manual_seed(seed)
    g = in_features if group_size == -1 else group_size
    n_groups = -(-in_features // g)
    codes = torch.randint(0, 16, (OUT_FEATURES, in_features), generator=gen)
    if sym:
        zeros = torch.full((n_groups, OUT_FEATURES), 8)
    else:
        zeros = torch.randint(min_zero, 16, (n_groups, OUT_FEATURES), generator=gen)
    scales = (torch.rand(n_groups, OUT_FEATURES, generator=gen) * 0.05 + 1e-3).half().float()
    return codes, zeros, scales, g


def dense_from_codes(codes, zeros, scales, g_idx, dtype) -> torch.Tensor:
    """Expected [in, out] weight in ``dtype``: (code - zero) * scale with the group of each input row."""
    groups = g_idx.long()
    return (codes.t().to(dtype) - zeros[groups].to(dtype)) * scales.half()[groups].to(dtype)


def load(config: dict, tensors: dict, dtype: torch.dtype, tmp_path, prefix: str = PREFIX,
         in_features: int = IN_FEATURES):
    method = get_quant_method(tmp_path, {"quantization_config": config})
    named = {f"{prefix}.{k}": v for k, v in tensors.items()}
    return method.load_linear(named.get, prefix, in_features, OUT_FEATURES, dtype)


def check_exact(packed, expected: torch.Tensor, dtype: torch.dtype) -> None:
    in_features = expected.shape[0]
    assert in_features % packed.group_size == 0  # the kernels' contract: whole groups
    got = dequantize_int4(packed.qweight, packed.scales, packed.zeros, packed.group_size)  # [in, out], permuted rows
    rows = packed.perm if packed.perm is not None else torch.arange(in_features)
    assert packed.scales.dtype == dtype and packed.zeros.dtype == dtype
    assert torch.equal(got, expected[rows])
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = w4a16_matmul(x, packed.qweight, packed.scales, packed.zeros, packed.group_size, packed.perm)
    torch.testing.assert_close(y.float(), (x.float() @ expected.float()), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- interop

@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_autoawq_gemm_checkpoint_dequantizes_bit_exactly(group_size, sym, dtype, tmp_path):
    codes, zeros, scales, g = random_quantized(group_size, sym, 0, seed=group_size + sym)
    g_idx = torch.arange(IN_FEATURES) // g
    weight = ((codes - zeros[g_idx].t()) * scales[g_idx].t()).float()  # what AutoAWQ's fake quantization leaves
    tensors = autoawq_from_linear(weight, scales, zeros.float(), g)
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    packed = load(config, tensors, dtype, tmp_path)
    assert packed.perm is None and packed.group_size == g
    check_exact(packed, dense_from_codes(codes, zeros, scales, g_idx, dtype), dtype)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_autogptq_checkpoint_dequantizes_bit_exactly(group_size, sym, fmt, act_order, tmp_path):
    dtype = torch.float16
    # AutoGPTQ's v1 cannot store a zero-point of 0 (it packs -1): its quantizer never emits one there.
    codes, zeros, scales, g = random_quantized(group_size, sym, 1 if fmt == "gptq" else 0, seed=7 * group_size + sym)
    g_idx = torch.arange(IN_FEATURES) // g
    if act_order:
        g_idx = g_idx[torch.randperm(IN_FEATURES, generator=torch.Generator().manual_seed(3))]
    weight = ((codes - zeros[g_idx.long()].t()) * scales[g_idx.long()].t()).float()
    tensors = autogptq_pack(weight, scales.t(), zeros.t().float(), g_idx, v1=(fmt == "gptq"))
    config = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": sym,
              "checkpoint_format": fmt}
    packed = load(config, tensors, dtype, tmp_path)
    if act_order and group_size != -1:
        assert packed.perm is not None
        assert torch.equal(g_idx[packed.perm], torch.arange(IN_FEATURES) // g)  # groups contiguous after sorting
    else:
        assert packed.perm is None
    check_exact(packed, dense_from_codes(codes, zeros, scales, g_idx, dtype), dtype)


@pytest.mark.parametrize("act_order", [False, True])
def test_autogptq_last_partial_group_loads_bit_exactly(act_order, tmp_path):
    """AutoGPTQ allows in % group_size != 0 (ceil(in / G) groups): 320 inputs, group 128 -> 128 + 128 + 64."""
    in_features = 320
    codes, zeros, scales, g = random_quantized(128, False, 1, seed=21, in_features=in_features)
    assert zeros.shape[0] == 3
    g_idx = torch.arange(in_features) // g
    if act_order:
        g_idx = g_idx[torch.randperm(in_features, generator=torch.Generator().manual_seed(4))]
    weight = ((codes - zeros[g_idx].t()) * scales[g_idx].t()).float()
    tensors = autogptq_pack(weight, scales.t(), zeros.t().float(), g_idx, v1=True)
    config = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": act_order, "sym": False}
    packed = load(config, tensors, torch.float16, tmp_path, in_features=in_features)
    check_exact(packed, dense_from_codes(codes, zeros, scales, g_idx, torch.float16), torch.float16)


def test_gptq_v1_zero_point_of_zero_round_trips_as_gptqmodel_converts_it(tmp_path):
    """GPTQModel writes v1 from v2 by subtracting 0x11111111 from each packed int32 (borrowing past zeros of 0)."""
    codes, zeros, scales, g = random_quantized(32, False, 0, seed=11)
    zeros[0, :8] = 0
    g_idx = torch.arange(IN_FEATURES) // g
    weight = ((codes - zeros[g_idx].t()) * scales[g_idx].t()).float()
    tensors = autogptq_pack(weight, scales.t(), zeros.t().float(), g_idx, v1=False)
    v2 = tensors["qzeros"].numpy().astype(np.int64)
    tensors["qzeros"] = torch.from_numpy(((v2 - 0x11111111) & 0xFFFFFFFF).astype(np.uint32).astype(np.int32))
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "checkpoint_format": "gptq"}
    check_exact(load(config, tensors, torch.float32, tmp_path),
                dense_from_codes(codes, zeros, scales, g_idx, torch.float32), torch.float32)


def test_legacy_quantize_config_json_is_read(tmp_path):
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 64, "desc_act": False,
                                                               "sym": True}))
    method = get_quant_method(tmp_path, {"architectures": ["LlamaForCausalLM"]})
    assert method.name == "gptq" and method.group_size == 64
    assert get_quant_method(tmp_path / "nothing-here", {"architectures": ["LlamaForCausalLM"]}) is None


def test_is_quantized_covers_decoder_linears_only(tmp_path):
    method = get_quant_method(tmp_path, {"quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True,
        "modules_to_not_convert": ["mlp.gate"]}})
    assert method.is_quantized("model.layers.0.self_attn.q_proj")
    assert method.is_quantized("model.layers.11.mlp.down_proj")
    assert not method.is_quantized("lm_head")
    assert not method.is_quantized("model.embed_tokens")
    assert not method.is_quantized("model.layers.2.mlp.gate_proj")  # excluded by modules_to_not_convert


# ---------------------------------------------------------------- refusals with actionable messages

@pytest.mark.parametrize("config, field, value", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method", "bitsandbytes"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version", "gemv"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "marlin"}, "version", "marlin"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, "version", "exllama"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point", "false"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits", "3"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits", "8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format",
     "marlin"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, "is_marlin_format", "true"),
])
def test_unsupported_quantization_config_names_the_field(config, field, value, tmp_path):
    with pytest.raises(EngineError) as info:
        get_quant_method(tmp_path, {"quantization_config": config})
    assert field in str(info.value) and value in str(info.value)
    assert info.value.param == field


def write_checkpoint(tmp_path, method: str) -> dict:
    """A one-layer quantized checkpoint on disk, in the tool's own packing."""
    codes, zeros, scales, g = random_quantized(64, False, 1, seed=5)
    g_idx = torch.arange(IN_FEATURES) // g
    weight = ((codes - zeros[g_idx].t()) * scales[g_idx].t()).float()
    if method == "awq":
        tensors = autoawq_from_linear(weight, scales, zeros.float(), g)
        qcfg = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
    else:
        tensors = autogptq_pack(weight, scales.t(), zeros.t().float(), g_idx, v1=True)
        qcfg = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": False}
    return {"config": {"architectures": ["LlamaForCausalLM"], "quantization_config": qcfg},
            "tensors": {f"{PREFIX}.{k}": v for k, v in tensors.items()}}


def load_from_disk(tmp_path, checkpoint: dict):
    """What the model loader does: config.json -> method; safetensors -> get_tensor (None when absent)."""
    (tmp_path / "config.json").write_text(json.dumps(checkpoint["config"]))
    save_file(checkpoint["tensors"], str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    method = get_quant_method(tmp_path, config)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        return method.load_linear(lambda n: f.get_tensor(n) if n in names else None, PREFIX, IN_FEATURES,
                                  OUT_FEATURES, torch.float16)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_checkpoint_with_wrong_shape_fails_naming_tensor_and_shapes(method, tmp_path):
    checkpoint = write_checkpoint(tmp_path, method)
    name = f"{PREFIX}.scales"
    checkpoint["tensors"][name] = checkpoint["tensors"][name][:, :32].contiguous()
    with pytest.raises(EngineError) as info:
        load_from_disk(tmp_path, checkpoint)
    message = str(info.value)
    assert name in message and "[4, 32]" in message and "[4, 64]" in message


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_checkpoint_with_missing_tensor_fails_naming_it(method, tmp_path):
    checkpoint = write_checkpoint(tmp_path, method)
    del checkpoint["tensors"][f"{PREFIX}.qzeros"]
    with pytest.raises(EngineError) as info:
        load_from_disk(tmp_path, checkpoint)
    assert f"{PREFIX}.qzeros" in str(info.value) and "missing" in str(info.value)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_input_features_that_are_not_whole_64_row_blocks_are_refused_naming_the_layer(method, tmp_path):
    """The kernels' packed layout holds 64 input rows a block: a layer of 96 (a valid AWQ / GPTQ shape at group
    size 32) is refused with its numbers before anything is read, not run wrong."""
    qcfg = write_checkpoint(tmp_path, method)["config"]["quantization_config"] | {"group_size": 32}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qcfg}))
    method_ = get_quant_method(tmp_path, json.loads((tmp_path / "config.json").read_text()))
    with pytest.raises(EngineError, match=rf"{PREFIX}.*in_features .* 96 is not a multiple of 64"):
        method_.load_linear(lambda name: None, PREFIX, 96, OUT_FEATURES, torch.float16)


def test_checkpoint_with_unknown_quant_method_fails_naming_it(tmp_path):
    checkpoint = write_checkpoint(tmp_path, "awq")
    checkpoint["config"]["quantization_config"]["quant_method"] = "squeezellm"
    with pytest.raises(EngineError) as info:
        load_from_disk(tmp_path, checkpoint)
    assert "quant_method" in str(info.value) and "squeezellm" in str(info.value)


def test_checkpoint_files_load_bit_exactly_from_disk(tmp_path):
    for method in ("awq", "gptq"):
        folder = tmp_path / method
        folder.mkdir()
        packed = load_from_disk(folder, write_checkpoint(folder, method))
        codes, zeros, scales, g = random_quantized(64, False, 1, seed=5)
        check_exact(packed, dense_from_codes(codes, zeros, scales, torch.arange(IN_FEATURES) // g, torch.float16),
                    torch.float16)
