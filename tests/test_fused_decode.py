"""The fused one-sequence decode layer (engine/models/fused_decode.py) computes what the unfused layer computes.

On CPU the reference backend runs both paths (``reference.w4a16_gemv`` and ``reference.dense_gemv`` compose the
unfused ops), so this checks the wiring: the residual stream updated in place, rotary at the right position, K
and V in the right cache slot, the final norm on the head's launch. On a GPU the same comparison runs with the
Triton kernels (the half2 int4 GEMV, the dense fp16 GEMV and their shared epilogues) on random-weight AWQ and
fp16 builds of real shapes.
"""

from __future__ import annotations

import pytest
import torch

from engine.forward_batch import ForwardBatch
from engine.model_loader import load_model
from engine.models.fused_decode import fused_decode_unsupported, x16_rows_supported
from kernels.ops import Backend

BLOCK_SIZE = 16


def _caches(model, num_blocks: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg = model.config
    shape = (num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    dtype = model.embed_tokens.dtype
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in model.layers]


def _batch(token_ids: list[int], start: int, block_table: list[int], device) -> ForwardBatch:
    """The tokens at positions start.. of one sequence whose blocks are ``block_table``."""
    n = len(token_ids)
    positions = torch.arange(start, start + n, device=device)
    slots = torch.tensor([block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions.tolist()],
                         device=device)
    return ForwardBatch(
        input_ids=torch.tensor(token_ids, device=device), positions=positions, slot_mapping=slots,
        block_tables=torch.tensor([block_table], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        context_lens=torch.tensor([start + n], dtype=torch.int32, device=device),
        logits_indices=torch.tensor([n - 1], device=device), is_decode=n == 1)


def _decode_logits(model, caches, token_ids, steps: int, fused: bool, device,
                   x16: bool | None = None) -> tuple[torch.Tensor, list]:
    """Prefill ``token_ids`` unfused, then ``steps`` greedy decode steps with the fused layer on or off (and
    with ``x16`` set, its int4 rows in 16-bit fixed point or not); returns the decode logits [steps, vocab] and
    the caches."""
    if x16 is not None:
        model.one_row_x16 = x16
    caches = [(k.clone(), v.clone()) for k, v in caches]
    model.bind_kv_caches(caches)
    table = [3, 1, 4, 0, 2]  # scattered blocks: slots must follow the table
    model.fuse_one_row_decode = False
    logits = model.forward(_batch(token_ids, 0, table, device))
    rows = []
    position = len(token_ids)
    for _ in range(steps):
        token = int(logits[-1].argmax())
        model.fuse_one_row_decode = fused
        step = _batch([token], position, table, device)
        logits = model.forward(step)
        rows.append(logits[0])
        position += 1
    return torch.stack(rows), caches


def _compare(model_dir, device: str, dtype: torch.dtype, backend: Backend, atol: float, steps: int = 4,
             x16: bool | None = None, lm_head_quantization: str = "none") -> None:
    """The unfused decode against the fused one (``x16``: with its int4 rows in 16-bit fixed point or not;
    None: as loaded)."""
    model = load_model(model_dir, torch.device(device), dtype, backend, max_positions=256,
                       lm_head_quantization=lm_head_quantization)
    caches = _caches(model, 5, device)
    prompt = torch.randint(5, model.config.vocab_size, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    unfused, caches_unfused = _decode_logits(model, caches, prompt, steps, False, device)
    fused, caches_fused = _decode_logits(model, caches, prompt, steps, True, device, x16)
    assert model.fuse_one_row_decode and torch.isfinite(fused).all()
    assert (fused - unfused).abs().max().item() <= atol
    assert torch.equal(fused.argmax(-1), unfused.argmax(-1))
    for (k_u, v_u), (k_f, v_f) in zip(caches_unfused, caches_fused):
        assert (k_u.float() - k_f.float()).abs().max().item() <= atol
        assert (v_u.float() - v_f.float()).abs().max().item() <= atol


def test_fused_decode_matches_unfused_on_cpu(awq_model_dir):
    # in float32 (the wiring is under test; the GPU kernel's fp16 arithmetic is checked on the GPU): equal up to
    # the summation order of the two CPU matmul paths
    _compare(awq_model_dir, "cpu", torch.float32, Backend(use_triton=False), atol=2e-3, steps=3)


def test_fused_decode_passes_the_int4_rows_in_16_bit_fixed_point_on_cpu(awq_model_dir):
    # o and down write the next norm's input as x16 planes, gate/up silu(gate) * up, and qkv (after layer 0),
    # gate/up and down read them: the reference backend checks each read planes are quantize_x16 of the row the
    # launch's dot takes, so a plane fed to the wrong launch fails here. The tiny model's matrices are below
    # the kernels' large-matrix plans, so the loader leaves x16 off and the test turns it on
    model = load_model(awq_model_dir, torch.device("cpu"), torch.float16, Backend(use_triton=False),
                       max_positions=64)
    assert fused_decode_unsupported(model) is None and not x16_rows_supported(model)
    _compare(awq_model_dir, "cpu", torch.float32, Backend(use_triton=False), atol=2e-3, steps=3, x16=True)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_fused_decode_matches_unfused_on_qwen_cpu(tmp_path, family):
    # tiny transformers-written checkpoints, AWQ by rounding: Qwen3's per-head q/k norms and Qwen2's qkv bias run
    # in the fused qkv epilogue
    from test_model_families import QWEN3_TINY, build_checkpoint, write_rtn_checkpoint

    dense = build_checkpoint(tmp_path / family, family, **(QWEN3_TINY if family == "qwen3" else {}))
    awq = write_rtn_checkpoint(dense, tmp_path / f"{family}-awq", group_size=32)
    model = load_model(awq, torch.device("cpu"), torch.float16, Backend(use_triton=False), max_positions=64)
    assert fused_decode_unsupported(model) is None
    assert model.config.qk_norm if family == "qwen3" else model.layers[0].qkv_proj.bias is not None
    _compare(awq, "cpu", torch.float32, Backend(use_triton=False), atol=2e-3, steps=3)


def test_fused_decode_runs_dense_fp16_models_on_cpu(default_model_dir):
    # the default model's fp16 weights go through the dense GEMV (kernels/triton/dense_gemv.py on a GPU), and
    # the final norm through the head's launch for every format
    model = load_model(default_model_dir, torch.device("cpu"), torch.float16, Backend(use_triton=False),
                       max_positions=64)
    assert fused_decode_unsupported(model) is None
    _compare(default_model_dir, "cpu", torch.float32, Backend(use_triton=False), atol=2e-3, steps=3)


def test_fused_decode_reads_the_int8_head_on_cpu(awq_model_dir):
    # --lm-head-quantization int8: the fused step's head launch reads the int8 rows and their scales (with the
    # final norm), the unfused step the W8A16 matmul; both must give the same logits
    _compare(awq_model_dir, "cpu", torch.float32, Backend(use_triton=False), atol=2e-3, steps=3,
             lm_head_quantization="int8")


def test_fused_decode_refuses_what_it_cannot_run(default_model_dir):
    model = load_model(default_model_dir, torch.device("cpu"), torch.float16, Backend(use_triton=False),
                       max_positions=64)
    layer = model.layers[0]
    layer.gate_up_proj.parts = [part.to(torch.bfloat16) for part in layer.gate_up_proj.parts]
    assert "a dense weight of torch.bfloat16" in fused_decode_unsupported(model)
    layer.gate_up_proj.parts = layer.gate_up_proj.parts * 2  # a merged layer kept in parts
    assert "not one weight" in fused_decode_unsupported(model)


def test_fused_decode_needs_fp16_activations(awq_model_dir):
    model = load_model(awq_model_dir, torch.device("cpu"), torch.float32, Backend(use_triton=False),
                       max_positions=64)
    assert fused_decode_unsupported(model) == "activations are not fp16"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape,quant", [("smollm2-135m", "awq"), ("llama2-7b", "awq"), ("smollm2-135m", "fp16"),
                                         ("llama2-7b-4l", "fp16")])
def test_fused_decode_matches_unfused_on_gpu(shape, quant):
    # random-weight builds of real shapes (the GPU machine has no default model): AWQ through the half2 GEMV,
    # fp16 through the dense one; the GEMVs round their partial sums differently from cuBLAS, so logits agree
    # within a few fp16 ulps rather than exactly
    from bench.common import DEFAULT_MODELS_DIR
    from bench.random_model import BuildSpec, build_model

    model_dir = build_model(DEFAULT_MODELS_DIR, BuildSpec(shape, quant), "cuda")
    model = load_model(model_dir, torch.device("cuda"), torch.float16, Backend(use_triton=True), max_positions=64)
    assert fused_decode_unsupported(model) is None and model.fuse_one_row_decode
    assert x16_rows_supported(model) == (shape == "llama2-7b")  # the 7B's int4 GEMVs can take x16 rows
    del model
    _compare(model_dir, "cuda", torch.float16, Backend(use_triton=True), atol=0.25)
    if shape == "llama2-7b":  # and with them: o, gate/up and down write the planes that the next launches read
        _compare(model_dir, "cuda", torch.float16, Backend(use_triton=True), atol=0.25, x16=True)
