"""SASS of the tensor-core W4A16 kernels' K loops, compiled for Hopper on a machine without a GPU.

Why: like bench/gemv_sass.py for the one-row GEMV, a loop's instruction mix (shuffles, shared-memory round trips,
converts) shows before any device time whether a change removes work or moves it; the K loop is found as the
innermost backward branch around the tensor-core instructions (the longest backward branch can be a wait's
slow path placed after the epilogue).

    PYTHONPATH=<triton 3.6> python3 bench/tensor_core_sass.py planes [--block-n 64] [--dtype bf16]
    PYTHONPATH=<triton 3.6> python3 bench/tensor_core_sass.py mma --block-m 128 --block-n 64 --warps 4 --stages 2
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from hopper_compile import (
    Constexpr,
    Descriptor,
    compile_source,
    disassemble,
    opcode,
    resource_usage,
    tensor_core_loop,
)

from kernels.triton.w4a16_mma import _mma_kernel
from kernels.triton.w4a16_planes import _planes_kernel

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def planes(args: argparse.Namespace):
    """The planes kernel as w4a16.py launches a 16-row tile of a K = N = 4096 weight (8 serial splits)."""
    dtype = DTYPES[args.dtype]
    values = {"x_ptr": dtype, "qw_ptr": torch.int32, "scales_ptr": dtype, "zeros_ptr": dtype,
              "perm_ptr": torch.int32, "out_ptr": dtype, "part_ptr": torch.float32, "lock_ptr": torch.int32,
              "M": 7, "N": 4096, "K": 4096, "k_per_split": 512, "splits": 8, "lock_rest": 1016, "stride_xm": 4096,
              "stride_om": 4096,
              **{key: Constexpr(value) for key, value in {
                  "GROUP_SIZE": 128, "HAS_PERM": False, "SERIAL": True, "USE_ASM": True, "BLOCK_M": 16,
                  "BLOCK_N": args.block_n, "BLOCK_K": 128, "SPLITS": 8}.items()}}
    return compile_source(_planes_kernel, values, num_warps=4, num_stages=3)


def mma(args: argparse.Namespace):
    """The transposed kernel on a 7B gate/up weight (K 4096, N 22016) at 128 rows, ``--splits`` splits."""
    dtype = DTYPES[args.dtype]
    x_src = Descriptor(dtype, (args.block_m, 128)) if args.x_tma else dtype
    values = {"x_src": x_src, "qw_desc": Descriptor(torch.int32, (16, args.block_n)), "scales_ptr": dtype,
              "zeros_ptr": dtype, "out_ptr": dtype, "part_ptr": torch.float32, "lock_ptr": torch.int32, "M": 128,
              "N": 22016, "K": 4096, "k_per_split": 4096 // args.splits, "splits": args.splits,
              "lock_rest": 1024 - args.splits, "stride_xm": 4096,
              "stride_om": 22016,
              **{key: Constexpr(value) for key, value in {
                  "GROUP_SIZE": 128, "USE_ASM": True, "BLOCK_M": args.block_m, "BLOCK_N": args.block_n,
                  "SPLITS": args.splits, "X_TMA": args.x_tma, "WARP_SPECIALIZE": args.warp_specialize}.items()}}
    return compile_source(_mma_kernel, values, num_warps=args.warps, num_stages=args.stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=["planes", "mma"])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--block-m", type=int, default=128)
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--x-tma", action="store_true", help="mma: x copied by TMA")
    parser.add_argument("--splits", type=int, default=1, help="mma: split-K (a power of two)")
    parser.add_argument("--warp-specialize", action="store_true", help="mma: a warp-specialized K loop")
    args = parser.parse_args()
    compiled = planes(args) if args.kernel == "planes" else mma(args)
    usage = resource_usage(compiled.asm["cubin"])
    loop = tensor_core_loop(disassemble(compiled.asm["cubin"]))
    print(f"registers {usage.registers}, spilled {usage.spilled_bytes} B; K loop {len(loop)} instructions a thread")
    print("  " + " ".join(f"{name}:{count}" for name, count in collections.Counter(map(opcode, loop)).most_common()))


if __name__ == "__main__":
    main()
