"""Split-K for the W4A16 kernels: the plan, and partial sums reduced in the launch that made them.

Why in the launch: a second reduce kernel is one more launch per matmul (~1.3 us in a graph) and a memset of
counters another. Each program stores its fp32 partial and takes a ticket from its column tile's counter;
the last to arrive sums the partials and writes the output. The counters live on the weight tensor
(``lock_buffer``) and are left at a multiple of LOCK_PERIOD after every call, so a launch needs no zeroing
and is CUDA-graph safe. One planner, one ticket, one sum and one release serve every W4A16 kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import cdiv

LOCK_PERIOD: tl.constexpr = tl.constexpr(1024)  # counters advance by this per call (a power of 2 >= arrivals)
LOCK_ATTR = "_pagoda_planes_lock"


def split_k(k: int, step: int, split: int) -> tuple[int, int]:
    """(k_per_split, splits): about ``split`` splits of K, each a whole number of ``step``s (the last step may
    run past K: a dense GEMV's K need not be a multiple of its step)."""
    steps = cdiv(k, step)
    per = cdiv(steps, max(1, min(split, steps))) * step
    return per, cdiv(k, per)


def lock_buffer(owner: torch.Tensor, tiles: int, reuse: bool, min_tiles: int | None = None) -> torch.Tensor:
    """Split-K arrival counters, int32 [tiles]. Kept on the tensor that owns them (a layer's weight or KV cache,
    so engines and layers never share one; calls on one owner run in stream order): the kernel leaves every
    counter at a multiple of LOCK_PERIOD, so it needs zeroing only when first made (a memset, also fine inside
    graph capture). The first buffer has ``min_tiles`` counters (default: one per 32 weight columns). The stored
    buffer is never replaced (a captured graph may hold it); a launch that needs more tiles than it has (forced
    tiles for M > 16 in benchmarks) gets fresh zeroed counters of its own."""
    lock = getattr(owner, LOCK_ATTR, None) if reuse else None
    if reuse and lock is None:
        first = min_tiles if min_tiles is not None else triton.cdiv(owner.shape[1], 32)
        lock = torch.zeros((max(tiles, first),), dtype=torch.int32, device=owner.device)
        setattr(owner, LOCK_ATTR, lock)
    if lock is None or lock.numel() < tiles:
        lock = torch.zeros((tiles,), dtype=torch.int32, device=owner.device)
    return lock


@triton.jit
def last_to_arrive(lock_ptr, counter, arrivals):
    """Take this program's ticket once its partial is stored; True for the last of ``arrivals`` programs.

    The counter starts each call at a multiple of LOCK_PERIOD (> any arrival count), so the ticket's remainder
    is the order of arrival (& rather than %: int32 wraps after 2M calls)."""
    tl.debug_barrier()  # every thread's partial is stored before the ticket is taken (release)
    ticket = tl.atomic_add(lock_ptr + counter, 1, sem="acq_rel", scope="gpu")
    return (ticket & (LOCK_PERIOD - 1)) == arrivals - 1


@triton.jit
def sum_partials(part_ptr, tile, mask, splits, split_stride, SPLITS: tl.constexpr):
    """The last program's total of a tile: the fp32 partials at offsets ``tile`` of each of the ``splits``
    partial blocks (``split_stride`` elements apart), ``SPLITS`` a power of 2 >= splits. Unrolled, so the loads
    are in flight together rather than one L2 round trip per split."""
    total = tl.zeros(tile.shape, tl.float32)
    for sk in tl.static_range(SPLITS):
        live = mask & ((tile * 0 + sk) < splits)  # (a tensor mask: the interpreter mistypes scalars)
        total += tl.load(part_ptr + sk * split_stride + tile, mask=live, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def rearm(lock_ptr, counter, lock_rest):
    """The last program rounds the counter up to the next multiple of LOCK_PERIOD (lock_rest = LOCK_PERIOD -
    arrivals), ready for the next call."""
    tl.atomic_add(lock_ptr + counter, lock_rest, sem="relaxed", scope="gpu")
