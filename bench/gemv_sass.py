"""SASS of the one-row GEMV's main loop, compiled for Hopper on a machine without a GPU: instructions per word.

Why: the M = 1 GEMV is issue-bound (BENCHMARKS.md, issue 15): at the H200's bandwidth an SM must retire ~28
thread-instructions per packed int4 word to keep up, so the loop's instruction count per word predicts its
speed before any device time is spent. Triton's wheel carries ptxas and cuobjdump, so the whole pipeline runs
here (tests/hopper_compile.py); this prints the loop's length, its instructions per word, an opcode histogram,
the register count and Triton's layouts (the layout decides how many words share one row of x pairs).

    python3 bench/gemv_sass.py --block-n 128 --block-k 64 --warps 1 --splits 32 [--norm] [--epilogue silu] [--sass F]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from hopper_compile import Constexpr, compile_source, disassemble, main_loop, opcode, resource_usage

from kernels.triton.w4a16_gemv import RESIDUAL, ROPE, SILU, STORE, _gemv_kernel

EPILOGUES = {"store": STORE, "residual": RESIDUAL, "silu": SILU, "rope": ROPE}
F16, F32, I32 = torch.float16, torch.float32, torch.int32
POINTERS = {"x_ptr": F16, "qw_ptr": I32, "scales_ptr": F16, "zeros_ptr": F16, "perm_ptr": I32, "out_ptr": F16,
            "part_ptr": F32, "lock_ptr": I32, "norm_ptr": F16, "cos_sin_ptr": F32, "pos_ptr": I32, "slot_ptr": I32,
            "k_cache_ptr": F16, "v_cache_ptr": F16, "q_norm_ptr": F16, "k_norm_ptr": F16, "bias_ptr": F16}


def compile_gemv(args: argparse.Namespace):
    """The GEMV specialized as the engine launches it for a K x N weight (Triton's CompiledKernel)."""
    rope = args.epilogue == "rope"
    constexprs = {"GROUP": args.group, "NORM": args.norm, "EPILOGUE": EPILOGUES[args.epilogue].value,
                  "HAS_PERM": False, "USE_ASM": True, "USE_PDL": True, "Q_SIZE": 4096 if rope else 0,
                  "KV_SIZE": 1024 if rope else 0, "HEAD_DIM": 128 if rope else 1, "QK_NORM": False,
                  "HAS_BIAS": False, "BLOCK_N": args.block_n, "BLOCK_K": args.block_k,
                  "SPLITS": triton.next_power_of_2(args.splits),
                  "NORM_BLOCK": triton.next_power_of_2(args.k) if args.norm else 1}
    scalars = {"N": args.n, "K": args.k, "k_per_split": 1024, "splits": args.splits, "lock_rest": 1000, "eps": 1e-5,
               "qk_eps": 1e-6}
    values = {**POINTERS, **scalars, **{name: Constexpr(value) for name, value in constexprs.items()}}
    return compile_source(_gemv_kernel, values, num_warps=args.warps, num_stages=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-n", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=64)
    parser.add_argument("--warps", type=int, default=1)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--splits", type=int, default=32, help="split-K (the epilogue sums this many partials)")
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=14336)
    parser.add_argument("--norm", action="store_true", help="the RMSNorm prologue")
    parser.add_argument("--epilogue", choices=sorted(EPILOGUES), default="store")
    parser.add_argument("--sass", help="also write the whole disassembly here")
    args = parser.parse_args()
    compiled = compile_gemv(args)
    instructions = disassemble(compiled.asm["cubin"])
    loop = main_loop(instructions)
    words = args.block_k // 8 * args.block_n // (32 * args.warps)  # packed words a thread handles per K step
    usage = resource_usage(compiled.asm["cubin"])
    print(f"registers {usage.registers}, spilled {usage.spilled_bytes} B; main loop {len(loop)} instructions for "
          f"{words} words a thread: {len(loop) / words:.1f} a word")
    print("  " + " ".join(f"{name}:{count}" for name, count in collections.Counter(map(opcode, loop)).most_common()))
    for line in compiled.asm["ttgir"].splitlines():
        if line.startswith("#blocked"):
            print("  " + line)
    if args.sass:
        Path(args.sass).write_text("\n".join(f"/*{address:04x}*/ {text}" for address, text in instructions) + "\n")


if __name__ == "__main__":
    main()
