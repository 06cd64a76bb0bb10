"""The one-row GEMV's arguments as its launcher specializes them, for compiling it without a GPU.

tests/test_kernel_compile.py compiles the variants the engine launches and bench/gemv_sass.py reads their SASS;
both take the constexprs from here, and here from the launchers' own K-step rules (``_k_steps``, ``split_k``),
so what is compiled is what a launch of that plan would run. The int4 and the dense GEMV share their tail's
arguments (kernels/triton/gemv_epilogue.py).
"""

from __future__ import annotations

import torch
import triton
from hopper_compile import Constexpr

from kernels.triton.dense_gemv import DenseGemvPlan
from kernels.triton.gemv_epilogue import ROPE, SILU, STORE, norm_block
from kernels.triton.split_k import split_k
from kernels.triton.w4a16_gemv import GemvPlan, _k_steps

F16, F32, I32 = torch.float16, torch.float32, torch.int32
POINTERS = {"x_ptr": F16, "qw_ptr": I32, "scales_ptr": F16, "zeros_ptr": F16, "perm_ptr": I32, "x16_ptr": I32,
            "out_ptr": F16,
            "part_ptr": F32, "squares_ptr": F32, "lock_ptr": I32, "norm_ptr": F16, "cos_sin_ptr": F32,
            "pos_ptr": I32, "slot_ptr": I32, "k_cache_ptr": F16, "v_cache_ptr": F16, "q_norm_ptr": F16,
            "k_norm_ptr": F16, "bias_ptr": F16, "normed_ptr": F16, "next_norm_ptr": F16, "normed_out_ptr": F16,
            "x16_out_ptr": I32}
DENSE_POINTERS = {"x_ptr": F16, "w_ptr": F16, **{name: dtype for name, dtype in POINTERS.items()
                                                if name not in ("x_ptr", "qw_ptr", "scales_ptr", "zeros_ptr", "perm_ptr",
                                                                "x16_ptr")}}
ROPE_SIZES = {"Q_SIZE": 4096, "KV_SIZE": 1024, "HEAD_DIM": 128}  # Llama-3-8B's q and kv widths, head size


def gemv_args(k: int, n: int, group: int, plan: GemvPlan, *, epilogue=STORE, norm: bool = False,
              perm: bool = False, qk_norm: bool = False, bias: bool = False, rope_sizes: dict | None = None,
              prescaled: bool = False, next_norm: bool = False, x16: bool = False, x16_out: bool = False) -> dict:
    """Arguments of ``_gemv_kernel`` for a K x N weight launched under ``plan`` (pointers as dtypes, scalars as
    values, constexprs wrapped); ``rope_sizes``: Q_SIZE, KV_SIZE, HEAD_DIM of a ROPE launch (default 8B's);
    ``prescaled``: a NORM launch reading x * weight from ``normed`` (as the engine launches it); ``next_norm``: a
    RESIDUAL launch writing the next norm's input too; ``x16``: the integer dot over x in 16-bit fixed point;
    ``x16_out``: the next norm's input or SiLU's product also written so."""
    k_per_split, splits, block_k = _k_steps(k, group, plan)
    own = {"GROUP": group, "HAS_PERM": perm, "USE_ASM": True, "BLOCK_N": plan.block_n, "BLOCK_K": block_k,
           "ONE_STEP": plan.one_step, "WEIGHTS_FIRST": plan.weights_first, "X16": x16}
    return _with_tail(POINTERS, own, k, n, k_per_split, splits, epilogue=epilogue, norm=norm, qk_norm=qk_norm,
                      bias=bias, rope_sizes=rope_sizes, prescaled=prescaled, next_norm=next_norm, x16_out=x16_out)


def dense_gemv_args(k: int, n: int, plan: DenseGemvPlan, *, epilogue=STORE, norm: bool = False,
                    qk_norm: bool = False, bias: bool = False, rope_sizes: dict | None = None,
                    prescaled: bool = False, next_norm: bool = False, int8: bool = False) -> dict:
    """``gemv_args`` for ``_dense_gemv_kernel``: an fp16 [N, K] weight launched under ``plan``; ``int8``: int8
    codes with a scale a row (the int8 LM head)."""
    k_per_split, splits = split_k(k, plan.block_k, plan.split)
    pointers = {**DENSE_POINTERS, "w_ptr": torch.int8 if int8 else F16}
    own = {"BLOCK_N": plan.block_n, "BLOCK_K": plan.block_k, "ROW_SCALES": int8}
    args = _with_tail(pointers, own, k, n, k_per_split, splits, epilogue=epilogue, norm=norm, qk_norm=qk_norm,
                      bias=bias, rope_sizes=rope_sizes, prescaled=prescaled, next_norm=next_norm)
    # rows contiguous: the stride is K; without row scales the launcher passes the weight as their (unread) pointer
    return {**args, "stride_wn": k, "row_scale_ptr": F16}


def _with_tail(pointers: dict, own: dict, k: int, n: int, k_per_split: int, splits: int, *, epilogue, norm: bool,
               qk_norm: bool, bias: bool, rope_sizes: dict | None, prescaled: bool, next_norm: bool,
               x16_out: bool = False) -> dict:
    """A kernel's ``pointers`` and ``own`` constexprs with the shared tail's scalars and constexprs
    (kernels/triton/gemv_epilogue.py ``epilogue_launch``)."""
    arrivals = splits * (2 if epilogue == SILU else 1)
    rope = (rope_sizes or ROPE_SIZES) if epilogue == ROPE else {"Q_SIZE": 0, "KV_SIZE": 0, "HEAD_DIM": 1}
    constexprs = {"NORM": norm, "EPILOGUE": epilogue.value, "USE_PDL": True, **rope, "QK_NORM": qk_norm,
                  "HAS_BIAS": bias, "SPLITS": triton.next_power_of_2(splits),
                  "NORM_BLOCK": norm_block(k, k_per_split, splits, epilogue == SILU) if norm else 1,
                  "PRESCALED": prescaled, "NEXT_NORM": next_norm, "X16_OUT": x16_out, **own}
    scalars = {"N": n, "K": k, "k_per_split": k_per_split, "splits": splits, "lock_rest": 1024 - arrivals,
               "eps": 1e-5, "qk_eps": 1e-6}
    return {**pointers, **scalars, **{name: Constexpr(value) for name, value in constexprs.items()}}
