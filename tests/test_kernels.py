"""Triton kernels agree with kernels/reference.py: under the CPU interpreter (CI) and on a GPU at 7B shapes.

The interpreter cases live in tests/kernel_cases.py and run in a subprocess, because TRITON_INTERPRET must be
set before Triton is first imported and other test modules may already have imported it in this process.
GPU tests use the same ``check_*`` functions with real shapes, ragged lengths, random non-contiguous block
tables and NaN-poisoned output memory; their command and last result are recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CASES = Path(__file__).with_name("kernel_cases.py")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cases():
    spec = importlib.util.spec_from_file_location("kernel_cases", CASES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_triton_ops_have_the_reference_signatures():
    from kernels import reference, triton_ops

    for name in [
        "rms_norm",
        "silu_and_mul",
        "rotary_embedding",
        "reshape_and_cache",
        "paged_attention",
        "paged_decode_attention",
        "w4a16_matmul",
        "w4a16_gemv",
        "dense_gemv",
        "w8a16_matmul",
        "masked_logits",
    ]:
        assert inspect.signature(getattr(triton_ops, name)) == inspect.signature(getattr(reference, name)), (
            name
        )


def test_triton_kernels_match_reference_under_interpreter():
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    # the cases on two workers (pytest-xdist): this process only waits meanwhile, and on CI's two cores the
    # interpreter's ~110 s become ~70
    workers = ["-n", "2"] if (os.cpu_count() or 1) > 1 else []
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, str(CASES)],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


# ---- GPU: Llama-2-7B / Llama-3-8B shapes (hidden 4096, inter 11008, 32 heads of 128, GQA 32/8) ----

DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_gpu_rms_norm(dtype, residual):
    _cases().check_rms_norm("cuda", dtype, tokens=333, hidden=4096, residual=residual)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("rows", "vocab", "words"), [(1, 49152, 1536), (32, 151936, 4748), (7, 32064, 1000)])
def test_gpu_masked_logits(rows, vocab, words):
    _cases().check_masked_logits("cuda", rows, vocab, words)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_silu_and_mul(dtype):
    _cases().check_silu_and_mul("cuda", dtype, tokens=333, inter=11008)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [32, 8])
def test_gpu_rotary(dtype, kv_heads):
    _cases().check_rotary("cuda", dtype, tokens=333, heads=32, kv_heads=kv_heads, head_dim=128, max_pos=4096)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_reshape_and_cache(dtype, block_size):
    _cases().check_reshape_and_cache(
        "cuda",
        dtype,
        tokens=777,
        kv_heads=8,
        head_dim=128,
        block_size=block_size,
        num_blocks=4096 // block_size * 16,
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [32, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_decode_attention_ragged_batch(dtype, kv_heads, block_size):
    gen = torch.Generator().manual_seed(block_size + kv_heads)
    lens = [1, 2, 15, 16, 17, 4096] + torch.randint(1, 4097, (58,), generator=gen).tolist()
    _cases().check_decode_attention("cuda", dtype, lens, 32, kv_heads, 128, block_size)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [32, 8])
def test_gpu_decode_attention_long_context_split_kv(dtype, kv_heads):
    # batch 1-2 with up to 32k tokens takes the flash-decoding split + reduce path
    _cases().check_decode_attention("cuda", dtype, [32768, 20001], 32, kv_heads, 128, 16)
    _cases().check_decode_attention("cuda", dtype, [32768], 32, kv_heads, 128, 32)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kv_heads,head_dim,heads", [(32, 128, 32), (8, 128, 32), (3, 64, 9)])
@pytest.mark.parametrize("block_n,warps", [(128, 8), (64, 4)])
def test_gpu_decode_attention_two_tiles_before_the_wait(kv_heads, head_dim, heads, block_n, warps):
    """Batch-1 decode with two tiles of keys loaded before the PDL wait (``PREFETCH_TILES``, timed by
    ``bench/kernels.py --only decode1``), at the catalog's head shapes: contexts inside the first tile, across
    both, and several partitions, at the split count the engine's graphs take for 4,096 tokens."""
    from kernels.triton.decode_attention import choose_splits, reduce_chunk

    config = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": 1, "PREFETCH_TILES": 2}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = choose_splits(1, kv_heads, 4096, block_n, sms, reduce_chunk(heads // kv_heads, head_dim))
    for ctx in (1, 100, 129, 256, 257, 1000, 4096):
        _cases().check_decode_attention("cuda", torch.float16, [ctx], heads, kv_heads, head_dim, 16, splits,
                                        config=config)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [32, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_prefill_attention_ragged_chunks(dtype, kv_heads, block_size):
    # fresh prompts, chunked prefill after a cached prefix (prefix-cache hit), single tokens, an empty chunk
    chunks = [(0, 1000), (512, 300), (37, 1), (4000, 17), (0, 1), (2048, 2048), (100, 0), (3, 129)]
    _cases().check_prefill_attention("cuda", dtype, chunks, 32, kv_heads, 128, block_size)


W4A16_SHAPES = [(4096, 4096), (4096, 22016), (11008, 4096), (4096, 12288), (4096, 6144)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 16, 33, 64, 128, 200, 256, 1024, 4096])
@pytest.mark.parametrize("k,n", W4A16_SHAPES)
def test_gpu_w4a16_7b_shapes(dtype, m, k, n):
    _cases().check_w4a16("cuda", dtype, m, k, n, 128, act_order=False)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 16, 100, 1024])
@pytest.mark.parametrize("group_size,act_order", [(32, True), (64, False), (-1, False)])
def test_gpu_w4a16_group_sizes_and_act_order(m, group_size, act_order):
    k = 4096
    _cases().check_w4a16("cuda", torch.float16, m, k, 4096, k if group_size == -1 else group_size, act_order)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["serial", "reduce", "no-split", "wide"])
@pytest.mark.parametrize("m,act_order", [(1, False), (5, True), (16, False)])
def test_gpu_w4a16_planes_variants(dtype, variant, m, act_order):
    # N = 4144 is not a multiple of any tile width: the edge tile's masks are exercised
    _cases().check_w4a16_planes("cuda", dtype, m, 4096, 4144, 128, act_order, variant)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["split", "no-split", "wide", "x-tma", "x-tma-ws", "256-rows"])
@pytest.mark.parametrize("m,act_order", [(17, False), (100, True), (128, False), (256, True)])
def test_gpu_w4a16_mma_variants(dtype, variant, m, act_order):
    # N = 4144 is not a multiple of any tile width: the edge tile's masks are exercised
    _cases().check_w4a16_mma("cuda", dtype, m, 4096, 4144, 128, act_order, variant)


def tuned_mma_cases() -> list[tuple[int, int, int]]:
    """(K, N, M) at both ends of every row bucket of the tuned tile table (kernels/triton/tuned.py)."""
    from kernels.triton.tuned import tuned_entries

    entries = tuned_entries("w4a16_mma")
    return sorted({(e.k, e.n, e.lower + 1) for e in entries} | {(e.k, e.n, e.rows) for e in entries})


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k,n,m", tuned_mma_cases())
def test_gpu_w4a16_at_the_tuned_tiles(k, n, m):
    """The default path where the tuned table applies: on the card it was swept on, its tiles run."""
    from kernels.triton.tuned import tuned_tile
    from kernels.triton.w4a16 import tensor_core_plan
    from kernels.triton.w4a16_mma import mma_config

    x = torch.empty((m, k), dtype=torch.float16, device="cuda")
    tile = tuned_tile("w4a16_mma", torch.cuda.get_device_name(), k, n, m)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert tensor_core_plan("mma", x, m, n, k) == mma_config(m, n, k, sms, tile)
    _cases().check_w4a16("cuda", torch.float16, m, k, n, 128, False)


GEMV_SHAPES = [(4096, 4096, 128), (4096, 28672, 128), (14336, 4096, 128), (4096, 6144, 128), (576, 960, 32),
               (576, 3072, 32), (1536, 576, 32), (4096, 4144, 128)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k,n,group_size", GEMV_SHAPES)
@pytest.mark.parametrize("act_order", [False, True])
def test_gpu_w4a16_gemv_shapes(k, n, group_size, act_order):
    # N = 4144 is not a multiple of any column tile: the edge tile's masks are exercised
    _cases().check_w4a16_gemv("cuda", k, n, group_size, act_order, "plain")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fusion", ["norm", "residual", "silu", "norm+silu", "prescaled-norm", "prescaled-norm+silu",
                                    "residual+next-norm"])
@pytest.mark.parametrize("k,n,group_size", [(4096, 28672, 128), (576, 3072, 32), (14336, 4096, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_w4a16_gemv_fusions(fusion, k, n, group_size, bias):
    _cases().check_w4a16_gemv("cuda", k, n, group_size, False, fusion, bias=bias)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k,n,group_size", GEMV_SHAPES + [(14336, 4096, 64), (11008, 4096, 128)])
@pytest.mark.parametrize("fusion,head_dim", [("plain", 32), ("prescaled-norm+silu", 32), ("residual+next-norm", 32),
                                             ("prescaled-norm+rope", 128), ("rope", 64)])
def test_gpu_w4a16_gemv_x16(k, n, group_size, fusion, head_dim):
    """The integer dot over x in 16-bit fixed point (DP2A, inline PTX: only the GPU runs it) at the engine's
    shapes, plans and fusions against the reference, on fresh random data."""
    if "rope" in fusion and n % (4 * head_dim):
        pytest.skip("a rotary launch's N is q + k + v heads")
    if "silu" in fusion and n == 4144:
        pytest.skip("a SiLU launch's gate and up are whole column tiles")
    if "next-norm" in fusion and n % 64:
        pytest.skip("the next GEMV's x16 row is whole 64-column blocks (hidden sizes are), which the launcher checks")
    _cases().check_w4a16_gemv("cuda", k, n, group_size, False, fusion, head_dim=head_dim, x16=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k,n,head_dim,group_size", [(4096, 8192, 128, 128), (576, 1024, 64, 32)])
@pytest.mark.parametrize("fusion", ["rope", "rope+qk-norm", "prescaled-norm+rope"])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_w4a16_gemv_rope_and_cache(k, n, head_dim, group_size, fusion, bias):
    _cases().check_w4a16_gemv("cuda", k, n, group_size, False, fusion, head_dim=head_dim, bias=bias)


DENSE_GEMV_SHAPES = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096), (4096, 32000), (4096, 128256),
                     (576, 960), (1536, 576), (576, 49152), (4096, 4098)]  # K x N; N = 4098: a half-empty edge tile


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k,n", DENSE_GEMV_SHAPES)
def test_gpu_dense_gemv_shapes(k, n):
    # the fp16 GEMV of the fused layer (fp16 models) and of every model's LM head, at the plans the engine launches
    _cases().check_dense_gemv("cuda", k, n, "plain")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fusion", ["norm", "residual", "silu", "norm+silu", "prescaled-norm", "prescaled-norm+silu",
                                    "residual+next-norm"])
@pytest.mark.parametrize("k,n", [(4096, 22016), (576, 3072), (11008, 4096)])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_dense_gemv_fusions(fusion, k, n, bias):
    _cases().check_dense_gemv("cuda", k, n, fusion, bias=bias)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k,n,head_dim", [(4096, 8192, 128), (576, 1024, 64)])
@pytest.mark.parametrize("fusion", ["rope", "rope+qk-norm", "prescaled-norm+rope"])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_dense_gemv_rope_and_cache(k, n, head_dim, fusion, bias):
    # rotary tiles of row pairs; with Qwen3's q/k norms, of whole heads
    _cases().check_dense_gemv("cuda", k, n, fusion, head_dim=head_dim, bias=bias)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k,n", [(4096, 128256), (3584, 152064), (4096, 32000), (576, 49152)])
@pytest.mark.parametrize("fusion", ["plain", "prescaled-norm"])
def test_gpu_dense_gemv_int8_heads(k, n, fusion):
    # --lm-head-quantization int8 at the catalog's heads (Llama-3-8B, Qwen2.5-7B, Llama-2-7B, SmolLM2), with the
    # final norm as the fused decode step launches it
    _cases().check_dense_gemv("cuda", k, n, fusion, int8=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 16, 17, 64, 128, 256, 1000])
@pytest.mark.parametrize("k,n", [(4096, 128256), (576, 49152)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_w8a16_matmul(m, k, n, dtype):
    # the int8 head's sampled rows outside the one-row step: batched decode up to 256 sequences, prompt logprobs
    _cases().check_w8a16_matmul("cuda", m, k, n, dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [64, 100, 256])
@pytest.mark.parametrize("tile", range(4))
def test_gpu_w8a16_matmul_many_row_tiles(m, tile):
    """The candidate tiles for many rows (``MANY_ROW_TILES``, timed by ``bench/gemv.py --dense``) on the 8B head,
    an uneven row count among them."""
    from kernels.triton.w8a16 import MANY_ROW_TILES

    _cases().check_w8a16_matmul("cuda", m, 4096, 128256, torch.float16, config=MANY_ROW_TILES[tile])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window", [1, 100, 4096])
def test_gpu_attention_sliding_window(window):
    # Mistral's 4,096-token window (and small ones) on contexts shorter and longer than it, split-KV decode included
    gen = torch.Generator().manual_seed(window)
    lens = [1, 17, 4096, 4097, 9000] + torch.randint(1, 9001, (11,), generator=gen).tolist()
    _cases().check_decode_attention("cuda", torch.float16, lens, 32, 8, 128, 16, sliding_window=window)
    _cases().check_decode_attention("cuda", torch.float16, [20000], 32, 8, 128, 16, sliding_window=window)
    chunks = [(0, 5000), (4500, 300), (37, 1), (8000, 17), (2048, 2048)]
    _cases().check_prefill_attention("cuda", torch.float16, chunks, 32, 8, 128, 16, sliding_window=window)
