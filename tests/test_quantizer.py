"""Our quantizer on the default model: AWQ and GPTQ checkpoints keep perplexity within 10% of fp16 and beat RTN.

AWQ and GPTQ are the catalog's bundled builds (made once per session, as a user's first load makes them);
RTN is built here. The checkpoints are read back through Pagoda's loader, dequantized into a plain
transformers model, and scored on data/heldout.txt, a text the calibration never saw. The layout checks
decode the written tensors with this file's own unpacking (AutoAWQ's column order, AutoGPTQ's v1
zero-points), not Pagoda's. The determinism tests build the first layers of the default model again, with
1 and with 2 threads, and compare bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.bundled import weights_sha256
from engine.errors import EngineError
from engine.quant.quantizer import BUNDLED_SETTINGS, quantize_model

ROOT = Path(__file__).resolve().parents[1]
GROUP = 32  # divides 576 and 1536; 128 does not divide SmolLM2's hidden size 576
LAYER0 = "model.layers.0"
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
METHODS = ("rtn", "awq", "gptq")
PARTIAL_LAYERS = 1  # layers of the default model rebuilt by the determinism tests (every layer has the same shapes)


@pytest.fixture(scope="session")
def quantized(default_model_dir, awq_model_dir, gptq_model_dir, tmp_path_factory) -> dict[str, Path]:
    """method -> checkpoint folder."""
    rtn = quantize_model(default_model_dir, tmp_path_factory.mktemp("quantized") / "rtn", "rtn",
                         group_size=GROUP, log=lambda msg: None, device="cpu")
    return {"rtn": rtn, "awq": awq_model_dir, "gptq": gptq_model_dir}


@pytest.fixture(scope="session")
def perplexities(quantized, heldout_agreement) -> dict[str, float]:
    """method -> perplexity on data/heldout.txt, and the fp16 model's (conftest's held-out comparison)."""
    result = {}
    for method, path in quantized.items():
        agreement = heldout_agreement(path)
        result["fp16"], result[method] = agreement.reference_perplexity, agreement.perplexity
        print(f"{method}: perplexity {result[method]:.3f} (fp16 {result['fp16']:.3f})")
    return result


@pytest.fixture(scope="session")
def partial_model_dir(default_model_dir, tmp_path_factory) -> Path:
    """The default model cut to its first PARTIAL_LAYERS decoder layers (same tensors, same tokenizer)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("partial") / "smollm2-partial"
    out.mkdir()
    config = json.loads((default_model_dir / "config.json").read_text())
    config["num_hidden_layers"] = PARTIAL_LAYERS
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(str(default_model_dir / "model.safetensors"))
    kept = {name: t for name, t in tensors.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < PARTIAL_LAYERS}
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    for path in default_model_dir.iterdir():
        if path.is_file() and path.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy2(path, out / path.name)
    return out


@pytest.fixture(scope="session")
def partial_builds(partial_model_dir, tmp_path_factory) -> dict[tuple[str, int], tuple[Path, list[str]]]:
    """(method, threads) -> (checkpoint of the partial model built with the bundled settings, progress log)."""
    out = tmp_path_factory.mktemp("partial-builds")
    builds = {}
    for method in ("awq", "gptq"):
        for threads in (1, 2):
            lines: list[str] = []
            settings = dict(BUNDLED_SETTINGS[method], cpu_threads=threads)
            path = quantize_model(partial_model_dir, out / f"{method}-t{threads}", method, log=lines.append,
                                  **settings)
            builds[method, threads] = (path, lines)
    return builds


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_calibration_and_heldout_texts_differ():
    calibration = (ROOT / "data" / "calibration.txt").read_text()
    heldout = (ROOT / "data" / "heldout.txt").read_text()
    assert len(heldout) > 4000 and len(calibration) > 15000
    sentences = {s.strip() for s in heldout.split(".") if len(s.strip()) > 30}
    assert not any(s in calibration for s in sentences)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_quantized_perplexity_within_10_percent_of_fp16(perplexities, method):
    assert perplexities[method] <= 1.10 * perplexities["fp16"], perplexities


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_and_gptq_beat_round_to_nearest(perplexities, method):
    assert perplexities[method] < perplexities["rtn"], perplexities


def test_progress_is_reported_per_layer(partial_builds):
    for method in ("awq", "gptq"):
        lines = partial_builds[method, 1][1]
        assert any(f"layer 1/{PARTIAL_LAYERS}" in line for line in lines)
        assert any(f"layer {PARTIAL_LAYERS}/{PARTIAL_LAYERS}" in line for line in lines)
        assert any("in float64" in line for line in lines)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_bundled_settings_give_the_same_bytes_with_1_and_2_threads(partial_builds, method):
    """The manifest's content hash of the weights is the same whatever the thread count."""
    one, two = (weights_sha256(partial_builds[method, threads][0]) for threads in (1, 2))
    assert one and one == two
    assert (partial_builds[method, 1][0] / "model.safetensors").read_bytes() == \
        (partial_builds[method, 2][0] / "model.safetensors").read_bytes()


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_partial_build_matches_the_bundled_build_layer_for_layer(partial_builds, quantized, method):
    """Layer i depends only on layers before it, so rebuilding the first layers reproduces the catalog build's."""
    partial = read_tensors(partial_builds[method, 1][0])
    full = read_tensors(quantized[method])
    layer_tensors = [name for name in partial if name.startswith("model.layers.")]
    assert len(layer_tensors) > 10 * PARTIAL_LAYERS
    for name in layer_tensors:
        assert torch.equal(partial[name], full[name]), name


def test_awq_checkpoint_has_autoawq_gemm_layout(quantized, default_model_dir):
    path = quantized["awq"]
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                             "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    source = json.loads((default_model_dir / "config.json").read_text())
    assert {k: v for k, v in config.items() if k not in ("quantization_config", "dtype")} == \
        {k: v for k, v in source.items() if k != "dtype"}
    tensors = read_tensors(path)
    for name in LINEARS:
        prefix = f"{LAYER0}.{name}"
        out_features = tensors[f"{prefix}.scales"].shape[1]
        in_features = tensors[f"{prefix}.qweight"].shape[0]
        assert f"{prefix}.weight" not in tensors
        assert tensors[f"{prefix}.qweight"].dtype == torch.int32
        assert tensors[f"{prefix}.qweight"].shape == (in_features, out_features // 8)
        assert tensors[f"{prefix}.qzeros"].dtype == torch.int32
        assert tensors[f"{prefix}.qzeros"].shape == (in_features // GROUP, out_features // 8)
        assert tensors[f"{prefix}.scales"].dtype == torch.float16
        assert tensors[f"{prefix}.scales"].shape == (in_features // GROUP, out_features)
    assert tensors["model.embed_tokens.weight"].dtype == torch.float16
    assert f"{LAYER0}.input_layernorm.weight" in tensors


def test_checkpoints_carry_tokenizer_and_chat_template(quantized, default_model_dir):
    wanted = [p.name for p in default_model_dir.iterdir()
              if p.name.startswith(("tokenizer", "chat_template", "generation_config", "special_tokens"))]
    assert "tokenizer.json" in wanted
    for method in METHODS:
        path = quantized[method]
        for name in wanted:
            assert (path / name).read_bytes() == (default_model_dir / name).read_bytes()
        assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no half-written temp folders


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM column order, decoded here independently: nibble i holds column [0,2,4,6,1,3,5,7][i]."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    out = torch.zeros(packed.shape[0], packed.shape[1] * 8, dtype=torch.int32)
    for col in range(packed.shape[1]):
        for i in range(8):
            out[:, col * 8 + order_map[i]] = (packed[:, col] >> (4 * i)) & 0xF
    return out


def test_rtn_checkpoint_decodes_to_nearest_grid_points(quantized, default_model_dir):
    """RTN written in AWQ layout: every weight decodes to within half a quantization step of the fp16 weight."""
    tensors = read_tensors(quantized["rtn"])
    source = read_tensors(default_model_dir)
    for name in LINEARS:
        prefix = f"{LAYER0}.{name}"
        codes = awq_unpack(tensors[f"{prefix}.qweight"]).float()  # [in, out]
        zeros = awq_unpack(tensors[f"{prefix}.qzeros"]).float().repeat_interleave(GROUP, dim=0)
        scales = tensors[f"{prefix}.scales"].float().repeat_interleave(GROUP, dim=0)
        decoded = (codes - zeros) * scales
        weight = source[f"{prefix}.weight"].float().t()
        assert ((decoded - weight).abs() <= 0.52 * scales + 1e-6).all(), name


def test_gptq_checkpoint_has_autogptq_v1_layout_and_act_order(quantized, default_model_dir):
    path = quantized["gptq"]
    qcfg = json.loads((path / "config.json").read_text())["quantization_config"]
    assert {k: qcfg[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format")} == \
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
         "checkpoint_format": "gptq"}
    assert qcfg["true_sequential"] is True and "damp_percent" in qcfg
    tensors = read_tensors(path)
    source = read_tensors(default_model_dir)
    for name in LINEARS:
        prefix = f"{LAYER0}.{name}"
        weight = source[f"{prefix}.weight"].float()  # [out, in]
        out_features, in_features = weight.shape
        qweight, qzeros = tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"]
        scales, g_idx = tensors[f"{prefix}.scales"], tensors[f"{prefix}.g_idx"]
        assert qweight.dtype == qzeros.dtype == g_idx.dtype == torch.int32 and scales.dtype == torch.float16
        assert qweight.shape == (in_features // 8, out_features) and g_idx.shape == (in_features,)
        assert qzeros.shape == (in_features // GROUP, out_features // 8)
        assert torch.equal(torch.bincount(g_idx.long()), torch.full((in_features // GROUP,), GROUP))
        assert not torch.equal(g_idx.long(), torch.arange(in_features) // GROUP)  # act-order permuted the groups
        shifts = torch.arange(0, 32, 4)
        codes = ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(in_features, out_features)
        zeros = (((qzeros[:, :, None] >> shifts) & 0xF) + 1).reshape(-1, out_features)  # v1 stores zero - 1
        decoded = ((codes - zeros[g_idx.long()]) * scales.float()[g_idx.long()]).t()
        relative_error = (decoded - weight).norm() / weight.norm()
        assert relative_error < 0.2, (name, float(relative_error))


def test_group_size_that_does_not_divide_the_hidden_size_is_refused(default_model_dir, tmp_path):
    with pytest.raises(EngineError) as info:
        quantize_model(default_model_dir, tmp_path / "out", "awq", group_size=128, log=lambda s: None)
    assert "group_size 128" in str(info.value) and "576" in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kwargs, param", [({"method": "squeeze"}, "method"), ({"method": "gptq", "bits": 3}, "bits"),
                                           ({"method": "awq", "sym": True}, "sym")])
def test_bad_quantizer_arguments_are_refused(default_model_dir, tmp_path, kwargs, param):
    with pytest.raises(EngineError) as info:
        quantize_model(default_model_dir, tmp_path / "out", group_size=64, log=lambda s: None, **kwargs)
    assert info.value.param == param


# ---------------------------------------------------------------- algorithm properties (fast, synthetic)

def test_clip_search_picks_what_autoawqs_direct_search_picks():
    """Our Gram-matrix clip search against AutoAWQ's _compute_best_clip loop, transcribed here."""
    from engine.quant.awq_search import search_clip

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=gen) * 0.05
    weight[:, 5] *= 8  # an outlier column makes clipping worthwhile
    inputs = torch.randn(300, 128, generator=gen)

    def pseudo_quantize(w):  # AutoAWQ zero-point pseudo_quantize_tensor, group 32
        shape = w.shape
        w = w.reshape(-1, 32)
        max_val, min_val = w.amax(dim=1, keepdim=True), w.amin(dim=1, keepdim=True)
        scales = (max_val - min_val).clamp(min=1e-5) / 15
        zeros = (-torch.round(min_val / scales)).clamp_(0, 15)
        return ((torch.clamp(torch.round(w / scales) + zeros, 0, 15) - zeros) * scales).reshape(shape)

    w = weight.reshape(64, 1, -1, 32)
    x = inputs.reshape(1, 300, -1, 32)
    org_out = (x * w).sum(dim=-1)
    org_max = w.abs().amax(dim=-1, keepdim=True)
    best_max, min_errs = org_max.clone(), torch.ones_like(org_max) * 1e9
    for i_s in range(10):
        max_val = org_max * (1 - i_s / 20)
        cur_out = (x * pseudo_quantize(torch.clamp(w, -max_val, max_val))).sum(dim=-1)
        err = (cur_out - org_out).pow(2).mean(dim=1).view(min_errs.shape)
        better = err < min_errs
        min_errs[better], best_max[better] = err[better], max_val[better]
    expected = best_max.squeeze(1).squeeze(-1)  # [out, n_groups]
    got = search_clip(weight, inputs, 32)
    assert (got == expected).float().mean() > 0.98  # ties within float noise may differ
    assert (got < weight.reshape(64, -1, 32).abs().amax(-1)).any()


def test_awq_scale_folding_keeps_the_full_precision_layer_unchanged():
    """apply_scales folds 1/s into the producer (norm, v_proj with GQA ties, up_proj) without changing outputs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.quant.awq_search import ScaleGroup, apply_scales
    from engine.quant.layers import v_channel_of_o_input

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=100)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norms
            p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        before = model(ids).logits
        layer = model.model.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        tie = v_channel_of_o_input(attn, attn.v_proj.out_features, attn.o_proj)
        assert tie is not None and tie.numel() == 64 and int(tie.max()) == 31
        dummy = torch.zeros(1, 1, 64)
        groups = [ScaleGroup(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], None, dummy),
                  ScaleGroup(attn.v_proj, [attn.o_proj], None, dummy, tie),
                  ScaleGroup(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], None, dummy),
                  ScaleGroup(mlp.up_proj, [mlp.down_proj], None, torch.zeros(1, 1, 128))]
        for group in groups:
            scales = torch.rand(group.inputs.shape[-1]) + 0.5
            if group.prev_channel is not None:
                scales = scales[group.prev_channel]  # tied channels share a scale
            apply_scales(group, scales)
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_gptq_error_compensation_beats_rounding_on_correlated_inputs():
    """On inputs with correlated features, GPTQ's output error is below round-to-nearest's."""
    from engine.quant.gptq_solver import GPTQConfig, HessianAccumulator, gptq_quantize
    from engine.quant.rtn import quantize_grouped

    gen = torch.Generator().manual_seed(0)
    mixing = torch.randn(128, 128, generator=gen) / 8
    inputs = torch.randn(2048, 128, generator=gen) @ mixing + torch.randn(2048, 128, generator=gen) * 0.1
    weight = torch.randn(96, 128, generator=gen) * 0.05
    acc = HessianAccumulator(128, "cpu")
    acc.add(inputs)
    reference = inputs @ weight.t()
    codes, scales, zeros = quantize_grouped(weight, 32, include_zero=True)
    groups = torch.arange(128) // 32
    rtn = (codes - zeros[groups].t()) * scales[groups].t()
    for desc_act in (False, True):
        result = gptq_quantize(weight, acc.hessian, GPTQConfig(group_size=32, desc_act=desc_act))
        gptq_error = (inputs @ result.dequantize().t() - reference).pow(2).mean()
        rtn_error = (inputs @ rtn.t() - reference).pow(2).mean()
        assert gptq_error < 0.7 * rtn_error, (desc_act, float(gptq_error), float(rtn_error))
        assert torch.equal(torch.bincount(result.g_idx.long()), torch.full((4,), 32))
