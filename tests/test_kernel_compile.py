"""Every variant of the one-row W4A16 GEMV that the fused decode layer launches compiles for Hopper (sm_90).

The interpreter tests (tests/test_kernels.py) check the arithmetic; this checks that Triton's code generator and
ptxas accept each specialization, which the interpreter never runs, and that none spills registers to local
memory. Compiled here without a GPU (tests/hopper_compile.py).
"""

from __future__ import annotations

import pytest
import torch
from hopper_compile import Constexpr, compile_for_hopper

from kernels.triton.w4a16_gemv import RESIDUAL, ROPE, SILU, STORE, _gemv_kernel

F16, F32, I32 = torch.float16, torch.float32, torch.int32
POINTERS = {"x_ptr": F16, "qw_ptr": I32, "scales_ptr": F16, "zeros_ptr": F16, "perm_ptr": I32, "out_ptr": F16,
            "part_ptr": F32, "lock_ptr": I32, "norm_ptr": F16, "cos_sin_ptr": F32, "pos_ptr": I32, "slot_ptr": I32,
            "k_cache_ptr": F16, "v_cache_ptr": F16}
SCALARS = {"N": 4096, "K": 4096, "k_per_split": 256, "splits": 11, "lock_rest": 1000, "eps": 1e-5}

# (name, epilogue, RMSNorm prologue, act-order perm, K steps in flight through shared memory)
VARIANTS = [
    ("plain", STORE, False, False, 1),
    ("act-order", STORE, False, True, 1),
    ("act-order+norm", STORE, True, True, 1),
    ("norm", STORE, True, False, 1),
    ("residual", RESIDUAL, False, False, 1),
    ("norm+silu", SILU, True, False, 1),
    ("norm+rope", ROPE, True, False, 1),
    ("pipelined", STORE, False, False, 3),
]


@pytest.mark.parametrize(("name", "epilogue", "norm", "perm", "stages"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_gemv_variant_compiles_for_hopper(name, epilogue, norm, perm, stages):
    rope = epilogue == ROPE
    constexprs = {"GROUP": 128, "NORM": norm, "EPILOGUE": epilogue.value, "HAS_PERM": perm, "USE_ASM": True,
                  "USE_PDL": True, "Q_SIZE": 4096 if rope else 0, "KV_SIZE": 1024 if rope else 0,
                  "HEAD_DIM": 128 if rope else 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLITS": 16,
                  "NORM_BLOCK": 4096 if norm else 1, "STAGES": stages}
    args = {**POINTERS, **SCALARS, **{key: Constexpr(value) for key, value in constexprs.items()}}
    kernel = compile_for_hopper(_gemv_kernel, args, num_warps=4)
    assert kernel.spilled_bytes == 0, f"{name}: {kernel.registers} registers, {kernel.spilled_bytes} B spilled"
    assert 0 < kernel.registers <= 255
