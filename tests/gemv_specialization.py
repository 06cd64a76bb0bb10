"""The one-row GEMV's arguments as its launcher specializes them, for compiling it without a GPU.

tests/test_kernel_compile.py compiles the variants the engine launches and bench/gemv_sass.py reads their SASS;
both take the constexprs from here, and here from the launcher's own K-step rule (``_k_steps``), so what is
compiled is what a launch of that plan would run.
"""

from __future__ import annotations

import torch
import triton
from hopper_compile import Constexpr

from kernels.triton.w4a16_gemv import ROPE, SILU, STORE, GemvPlan, _k_steps, norm_block

F16, F32, I32 = torch.float16, torch.float32, torch.int32
POINTERS = {"x_ptr": F16, "qw_ptr": I32, "scales_ptr": F16, "zeros_ptr": F16, "perm_ptr": I32, "out_ptr": F16,
            "part_ptr": F32, "squares_ptr": F32, "lock_ptr": I32, "norm_ptr": F16, "cos_sin_ptr": F32,
            "pos_ptr": I32, "slot_ptr": I32, "k_cache_ptr": F16, "v_cache_ptr": F16, "q_norm_ptr": F16,
            "k_norm_ptr": F16, "bias_ptr": F16, "normed_ptr": F16, "next_norm_ptr": F16, "normed_out_ptr": F16}
ROPE_SIZES = {"Q_SIZE": 4096, "KV_SIZE": 1024, "HEAD_DIM": 128}  # Llama-3-8B's q and kv widths, head size


def gemv_args(k: int, n: int, group: int, plan: GemvPlan, *, epilogue=STORE, norm: bool = False,
              perm: bool = False, qk_norm: bool = False, bias: bool = False, rope_sizes: dict | None = None,
              prescaled: bool = False, next_norm: bool = False) -> dict:
    """Arguments of ``_gemv_kernel`` for a K x N weight launched under ``plan`` (pointers as dtypes, scalars as
    values, constexprs wrapped); ``rope_sizes``: Q_SIZE, KV_SIZE, HEAD_DIM of a ROPE launch (default 8B's);
    ``prescaled``: a NORM launch reading x * weight from ``normed`` (as the engine launches it); ``next_norm``: a
    RESIDUAL launch writing the next norm's input too."""
    k_per_split, splits, block_k = _k_steps(k, group, plan)
    arrivals = splits * (2 if epilogue == SILU else 1)
    rope = (rope_sizes or ROPE_SIZES) if epilogue == ROPE else {"Q_SIZE": 0, "KV_SIZE": 0, "HEAD_DIM": 1}
    constexprs = {"GROUP": group, "NORM": norm, "EPILOGUE": epilogue.value, "HAS_PERM": perm, "USE_ASM": True,
                  "USE_PDL": True, **rope, "QK_NORM": qk_norm, "HAS_BIAS": bias, "BLOCK_N": plan.block_n,
                  "BLOCK_K": block_k, "SPLITS": triton.next_power_of_2(splits),
                  "NORM_BLOCK": norm_block(k, k_per_split, splits, epilogue == SILU) if norm else 1,
                  "ONE_STEP": plan.one_step, "PRESCALED": prescaled, "NEXT_NORM": next_norm}
    scalars = {"N": n, "K": k, "k_per_split": k_per_split, "splits": splits, "lock_rest": 1024 - arrivals,
               "eps": 1e-5, "qk_eps": 1e-6}
    return {**POINTERS, **scalars, **{name: Constexpr(value) for name, value in constexprs.items()}}
