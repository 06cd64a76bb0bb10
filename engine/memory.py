"""Where device memory goes: weights, KV (allocated and in use), activations, graphs, other processes, free."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class MemoryReport:
    """Bytes. On CPU ``device_*`` describe system RAM and ``process_rss`` is this process's resident memory."""

    device: str
    device_name: str
    device_total: int
    device_used: int
    device_free: int
    weights: int
    kv_allocated: int
    kv_in_use: int
    activation_reserve: int
    cuda_graph_pool: int
    other_processes: int
    process_rss: int

    @property
    def kv_free(self) -> int:
        return self.kv_allocated - self.kv_in_use

    def as_dict(self) -> dict:
        data = asdict(self)
        data["kv_free"] = self.kv_free
        return data


def device_bytes_outside_torch(device: torch.device) -> int:
    """Device memory in use that torch's caching allocator does not hold: this process's CUDA context, loaded
    kernels and library handles (and anything other processes hold, which the budget cannot use either). The
    driver (and nvidia-smi) count the first part against the process, so the KV sizing does too."""
    free, total = torch.cuda.mem_get_info(device)
    return max(total - free - torch.cuda.memory_reserved(device), 0)


def cuda_index(device: torch.device) -> int:
    """The device's index (torch's per-device settings take an index; "cuda" alone is the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def allocator_limit(device: torch.device) -> int:
    """The bytes torch's caching allocator may hold on ``device`` under its per-process memory fraction (0: no
    limit, the fraction at 1)."""
    return _allocator_limit_at(cuda_index(device))


def _allocator_limit_at(index: int) -> int:
    fraction = torch.cuda.get_per_process_memory_fraction(index)
    return 0 if fraction >= 1.0 else round(fraction * torch.cuda.get_device_properties(index).total_memory)


class TorchPoolLimit:
    """One engine's share of the limit on torch's caching allocator for its device (bytes; 0 = none held).

    Why: the KV pool is sized so that torch's pool at its start-up peak plus the memory outside it fits the
    budget, but serving then asks the allocator for blocks of sizes start-up never did (eager steps, sampling
    at every row count), and a block cached at one size does not always serve another: an 8B AWQ top-p load
    grew torch's pool 4.2 GiB past its 24 GiB budget (BENCHMARKS.md issue 16, session 16). Under a limit the
    allocator returns its cached blocks to the driver and retries before it grows past it, so the process stays
    within the budget as the driver counts it; it fails only if live tensors alone would not fit.

    The limit is torch's per-process memory fraction, one per device and process, so each engine adds its
    share to it and takes it back when released: engines of one process (a model switch that keeps the old
    one serving while the new one loads) each keep their own room."""

    NO_LIMIT_BELOW = 2**20  # a sum of shares this small is rounding left by released ones: no limit

    def __init__(self, device: torch.device):
        self.index = cuda_index(device)
        self.bytes = 0
        self._total = torch.cuda.get_device_properties(self.index).total_memory

    def hold(self, nbytes: int) -> None:
        """Make this engine's share ``nbytes`` (the others' shares stay); 0 gives it back. A share the budget
        cannot cover (the memory outside torch exceeds it) is the smallest one, not none: the load then fails
        with the budget's message instead of running unlimited."""
        if nbytes != 0:
            nbytes = max(nbytes, self.NO_LIMIT_BELOW)
        limit = _allocator_limit_at(self.index) - self.bytes + nbytes
        self.bytes = nbytes
        fraction = 1.0 if limit < self.NO_LIMIT_BELOW or limit >= self._total else limit / self._total
        torch.cuda.set_per_process_memory_fraction(fraction, self.index)

    def release(self) -> None:
        self.hold(0)


def process_rss() -> int:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


def memory_report(engine) -> MemoryReport:
    """Build the report for one LLMEngine (``engine.runner`` holds the sizes measured at load)."""
    runner = engine.runner
    layout = runner.layout
    kv_allocated = layout.num_blocks * layout.bytes_per_block
    kv_in_use = engine.kv_manager.block_pool.num_used_blocks * layout.bytes_per_block
    rss = process_rss()
    graph_pool = getattr(runner, "cuda_graph_pool_bytes", 0)
    activation = runner.memory_profile.activation_peak
    if runner.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(runner.device)
        used = total - free
        ours = torch.cuda.memory_reserved(runner.device)
        other = max(used - ours, 0)
        name = torch.cuda.get_device_name(runner.device)
    else:
        import psutil

        vm = psutil.virtual_memory()
        total, free, used = vm.total, vm.available, vm.total - vm.available
        other = max(used - rss, 0)
        name = "CPU (system memory)"
    return MemoryReport(device=str(runner.device), device_name=name, device_total=total, device_used=used,
                        device_free=free, weights=runner.weight_bytes, kv_allocated=kv_allocated,
                        kv_in_use=kv_in_use, activation_reserve=activation, cuda_graph_pool=graph_pool,
                        other_processes=other, process_rss=rss)
