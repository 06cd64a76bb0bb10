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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from gemv_specialization import gemv_args
from hopper_compile import compile_source, disassemble, main_loop, opcode, resource_usage

from kernels.triton.gemv_epilogue import RESIDUAL, ROPE, SILU, STORE
from kernels.triton.w4a16_gemv import GemvPlan, _gemv_kernel, _k_steps

EPILOGUES = {"store": STORE, "residual": RESIDUAL, "silu": SILU, "rope": ROPE}


def compile_gemv(args: argparse.Namespace, plan: GemvPlan):
    """The GEMV specialized as the engine launches it for a K x N weight (Triton's CompiledKernel)."""
    values = gemv_args(args.k, args.n, args.group, plan, epilogue=EPILOGUES[args.epilogue], norm=args.norm,
                       prescaled=args.prescaled, next_norm=args.next_norm, x16=args.x16,
                        x16_out=args.x16_out)
    return compile_source(_gemv_kernel, values, num_warps=args.warps, num_stages=1, maxnreg=plan.max_registers)


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
    parser.add_argument("--prescaled", action="store_true", help="with --norm: x * weight read from normed")
    parser.add_argument("--next-norm", action="store_true", help="with --epilogue residual: the next norm's input")
    parser.add_argument("--epilogue", choices=sorted(EPILOGUES), default="store")
    parser.add_argument("--one-step", action="store_true", help="each split in one masked K step")
    parser.add_argument("--max-registers", type=int, default=None, help="ptxas's cap (the plan's max_registers)")
    parser.add_argument("--x16", action="store_true", help="the integer dot over x in 16-bit fixed point")
    parser.add_argument("--x16-out", action="store_true", help="with --next-norm or silu: the row also as x16")
    parser.add_argument("--sass", help="also write the whole disassembly here")
    args = parser.parse_args()
    plan = GemvPlan(args.block_n, args.block_k, args.splits, args.warps, one_step=args.one_step,
                    max_registers=args.max_registers)
    compiled = compile_gemv(args, plan)
    instructions = disassemble(compiled.asm["cubin"])
    loop = main_loop(instructions) if not args.one_step else [text for _, text in instructions]
    block_k = _k_steps(args.k, args.group, plan)[2]
    words = block_k // 8 * args.block_n // (32 * args.warps)  # packed words a thread handles per K step
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
