"""Compile a Triton kernel for Hopper (sm_90) on a machine without a GPU, and read its register use.

Why: the interpreter runs a kernel's arithmetic but not Triton's code generator, so a kernel can pass every CPU
test and still fail to compile on the GPU (a variable retyped in one branch of an ``if`` did, in session 6).
Triton's wheel carries ptxas and cuobjdump, so the whole pipeline (ttir, ttgir, PTX, cubin) runs here; the
register count is what decides how many programs share an SM, the first thing a GEMV's speed depends on.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
HOPPER_SHARED_BYTES = 227 * 1024  # the most shared memory one block of an sm_90 kernel may use
POINTER_TYPES = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
                 torch.int64: "*i64", torch.int8: "*i8"}


@dataclass(frozen=True)
class Constexpr:
    """A compile-time argument's value."""

    value: object


@dataclass(frozen=True)
class Descriptor:
    """A host tensor descriptor argument (``triton.tools.tensor_descriptor.TensorDescriptor``) of a dtype and block."""

    dtype: torch.dtype
    block: tuple[int, ...]


@dataclass(frozen=True)
class HopperKernel:
    registers: int  # per thread
    spilled_bytes: int  # stack frame + local memory per thread (spills)
    shared_bytes: int  # what the launch asks for (the pipeline's buffers and layout conversions)
    register_operand_mmas: int = 0  # wgmma instructions whose A operand is in registers (not in shared memory)


def _arg_type(value) -> str:
    if isinstance(value, Constexpr):
        return "constexpr"
    if isinstance(value, torch.dtype):
        return POINTER_TYPES[value]
    if isinstance(value, Descriptor):
        return f"tensordesc<{POINTER_TYPES[value.dtype].lstrip('*')}[{','.join(map(str, value.block))}]>"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def compile_source(kernel, args: dict, num_warps: int = 4, num_stages: int = 3, maxnreg: int | None = None):
    """Compile ``kernel`` (a ``@triton.jit`` function) for sm_90 and return Triton's CompiledKernel (its
    ``asm`` holds ttgir, PTX and the cubin): ``args`` maps every argument name to a tensor dtype (a pointer), an
    int / float (a runtime scalar) or a ``Constexpr``. Raises Triton's CompilationError.

    Specialized as Triton's launcher specializes a real launch: pointers 16-byte aligned, ints that are multiples
    of 16 known to be (which lets it vectorize loads whose masks compare with them)."""
    missing = set(kernel.arg_names) - set(args)
    if missing:
        raise ValueError(f"compile_for_hopper: no value for {sorted(missing)}")
    signature = {name: _arg_type(args[name]) for name in kernel.arg_names}
    constexprs = {name: value.value for name, value in args.items() if isinstance(value, Constexpr)}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if isinstance(args[name], torch.dtype)
               or (type(args[name]) is int and args[name] % 16 == 0)}  # type(): a bool is not an int here
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=aligned)
    options = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(source, target=HOPPER, options=options)


def compile_for_hopper(kernel, args: dict, num_warps: int = 4, num_stages: int = 3,
                       maxnreg: int | None = None) -> HopperKernel:
    """``compile_source``'s kernel, as its resource use: registers, spills, shared memory, register-A wgmmas."""
    compiled = compile_source(kernel, args, num_warps, num_stages, maxnreg)
    usage = resource_usage(compiled.asm["cubin"])
    # wgmma ... {d regs}, {a regs}, b-descriptor: a brace-enclosed A operand is in registers (a descriptor is not)
    register_a = len(re.findall(r"wgmma\.mma_async\S*\s+\{[^}]*\},\s*\{", compiled.asm["ptx"]))
    return HopperKernel(usage.registers, usage.spilled_bytes, max(usage.shared_bytes, compiled.metadata.shared),
                        register_a)


def resource_usage(cubin: bytes) -> HopperKernel:
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run([str(cuobjdump), "--dump-resource-usage", file.name], capture_output=True,
                                text=True, check=True).stdout

    def field(name: str) -> int:
        match = re.search(rf"\b{name}:(\d+)", report)
        return int(match.group(1)) if match else 0

    # spills land in the stack frame (STACK); LOCAL counts only declared local arrays, and stays 0 for spills
    return HopperKernel(field("REG"), field("STACK") + field("LOCAL"), field("SHARED"))


INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def disassemble(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS instruction of a cubin, predicates included."""
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([str(cuobjdump), "-sass", file.name], capture_output=True, text=True,
                              check=True).stdout
    return [(int(m.group(1), 16), m.group(2)) for m in map(INSTRUCTION.match, text.splitlines()) if m]


def _backward_branches(instructions: list[tuple[int, str]]):
    """(target, address) of every branch back to an earlier instruction: a loop's start and end."""
    for address, text in instructions:
        target = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            yield int(target.group(1), 16), address


def _body(instructions: list[tuple[int, str]], start: int, end: int) -> list[str]:
    return [text for address, text in instructions if start <= address <= end]


def main_loop(instructions: list[tuple[int, str]]) -> list[str]:
    """The body of the longest backward branch (a kernel's main loop), as instruction texts."""
    start, end = max(_backward_branches(instructions), key=lambda loop: loop[1] - loop[0], default=(0, 0))
    return _body(instructions, start, end)


def tensor_core_loop(instructions: list[tuple[int, str]]) -> list[str]:
    """The innermost loop that holds every tensor-core instruction (HMMA / HGMMA), as instruction texts: the
    longest backward branch can be a wait's slow path placed after the epilogue."""
    mmas = [address for address, text in instructions if "MMA" in opcode(text)]
    around = [(start, end) for start, end in _backward_branches(instructions) if start <= mmas[0] and end >= mmas[-1]]
    start, end = min(around, key=lambda loop: loop[1] - loop[0])
    return _body(instructions, start, end)


def opcode(text: str) -> str:
    """An instruction's opcode, without its predicate."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
