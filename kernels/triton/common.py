"""Small launch helpers shared by the kernel families: interpreter detection, SM count, autotune bypass."""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton

try:  # programmatic dependent launch (Triton >= 3.3): re-exported for the kernels that use it
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # pragma: no cover (older Triton: kernels launch without PDL)
    gdc_launch_dependents = gdc_wait = None
    HAS_GDC = False


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tests): no autotuning, small fixed tiles."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=16)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str:
    """The card's name as the driver gives it ("NVIDIA H200"), which keys the tuned tiles; "" on CPU."""
    if device.type != "cuda":
        return ""
    return _device_name(device.index if device.index is not None else torch.cuda.current_device())


def num_sms(device: torch.device) -> int:
    """Multiprocessors of the device (a small stand-in on CPU so split heuristics still get exercised)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs Hopper or newer (and a real GPU, not the interpreter): a launch may
    then start while the previous kernel finishes, and waits (``gdc_wait``) only where it reads that kernel's
    output, which hides the ~1.3 us dependency gap between kernels inside a CUDA graph."""
    return (HAS_GDC and device.type == "cuda" and not interpreting()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def autotune_disk_cache() -> dict:
    """``triton.autotune`` keyword that keeps the chosen configs in Triton's on-disk cache, so a second start
    (of the server, of a graph capture) reuses the timings instead of benchmarking every config again; empty on
    Triton versions without it."""
    return {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


SM_REGISTERS = 65536  # 32-bit registers in one SM's register file (sm_80 to sm_90)


def warps_an_sm_holds(registers: int) -> int:
    """Warps of ``registers`` registers a thread that an SM's register file holds at once: how many programs a
    launch keeps resident, which decides whether its grid is one wave."""
    return SM_REGISTERS // (32 * registers)


def maxnreg_option(cap: int | None) -> dict:
    """The launch option that caps ptxas's registers a thread at ``cap`` (Triton's maxnreg); none for None."""
    return {"maxnreg": cap} if cap else {}


def largest_pow2_divisor(n: int, largest: int) -> int:
    """The largest power of two <= ``largest`` (a power of two) that divides ``n``."""
    step = largest
    while n % step:
        step //= 2
    return step


def launch(kernel, grid, *args, config: dict | None = None, **kwargs) -> None:
    """Launch ``kernel`` (a JITFunction or an Autotuner). Under the interpreter, or when ``config`` is given,
    an Autotuner's wrapped function is called with that config, so tests run one fixed, cheap tile shape."""
    if config is not None:
        fn = getattr(kernel, "fn", kernel)
        fn[grid](*args, **kwargs, **config)
    else:
        kernel[grid](*args, **kwargs)
