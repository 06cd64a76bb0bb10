"""Hold a CUDA stream until the host opens a gate, so work that reads host data can be queued before the data exists.

A constrained step samples through its grammar masks, which the grammar process computes while the engine's
thread queues the forward and does the previous step's text (engine/grammar_worker.py). Queuing the sampling
only once the masks were ready would put the sampler's host work and its device time after the grammar work, on
the step's critical path. With a gate the sampling is queued with the forward: the stream waits on a word of
device-mapped host memory (``cuStreamWaitValue32``, a stream memory operation of the driver: the device waits
without a spinning kernel) until it holds the step's ticket, which the grammar process writes once the masks
are written; the copies and kernels queued behind the wait then read the finished masks.

Tickets count up; the wait is the driver's cyclic ``>=``, so wrap-around is harmless. A ticket waited for must
be opened, whatever happens to the writer (the engine opens it itself when the grammar process dies): a stream
held forever stalls the device.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch

log = logging.getLogger("pagoda.stream_gate")

_CU_STREAM_WAIT_VALUE_GEQ = 0x0  # wait until (int32_t)(*addr - value) >= 0
_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2


class _Driver:
    """The two CUDA driver entry points the gate needs (torch exposes neither)."""

    def __init__(self, lib: ctypes.CDLL):
        self.wait_value = lib.cuStreamWaitValue32_v2
        self.wait_value.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self.wait_value.restype = ctypes.c_int
        self.device_pointer = lib.cuMemHostGetDevicePointer_v2
        self.device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        self.device_pointer.restype = ctypes.c_int

    @classmethod
    def load(cls) -> _Driver | None:
        for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
            try:
                return cls(ctypes.CDLL(name))
            except (OSError, AttributeError):
                continue
        return None


class StreamGate:
    """A ticket word in device-mapped host memory and the driver call that makes a stream wait for it; see the
    module docstring. Whoever writes the data writes the word (the grammar process its shared done word)."""

    def __init__(self, driver: _Driver, device: torch.device, word: np.ndarray):
        self._driver, self._device = driver, device
        address = ctypes.c_uint64()  # word: [1] int32, pinned or registered (the caller keeps it alive)
        status = driver.device_pointer(ctypes.byref(address), ctypes.c_void_p(word.ctypes.data), 0)
        if status != 0:
            raise RuntimeError(f"cuMemHostGetDevicePointer failed ({status})")
        self._device_address = address.value

    @classmethod
    def for_device(cls, device: torch.device, word: np.ndarray) -> StreamGate | None:
        """A gate for ``device``'s streams over ``word``, or None where there is none (not CUDA, no driver
        entry point, memory the device cannot map, a device without stream memory operations): the caller then
        waits on the host instead."""
        if device.type != "cuda":
            return None
        driver = _Driver.load()
        if driver is None:
            return None
        try:
            with torch.cuda.device(device):
                gate = cls(driver, device, word)
                gate.hold(int(word[0]))  # open already: one round trip proves the driver accepts the wait
                torch.cuda.current_stream(device).synchronize()
        except RuntimeError as exc:
            log.info("no stream gate on %s (%s): the host waits for the data instead", device, exc)
            return None
        return gate

    def hold(self, ticket: int) -> int:
        """Queue, on the device's current stream, a wait until the word holds ``ticket`` (or a later one);
        returns the ticket. Writes before the word's are visible to the work queued behind the wait."""
        stream = torch.cuda.current_stream(self._device).cuda_stream
        status = self._driver.wait_value(ctypes.c_void_p(stream), self._device_address, ticket,
                                         _CU_STREAM_WAIT_VALUE_GEQ)
        if status != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed ({status})")
        return ticket


def register_host_memory(address: int, size: int) -> bool:
    """Pin (page-lock and map) host memory the process did not get from CUDA, so copies from it are
    asynchronous and a gate can watch a word in it; False when the driver refuses."""
    status = torch.cuda.cudart().cudaHostRegister(address, size, _CUDA_HOST_REGISTER_PORTABLE_MAPPED)
    return int(status) == 0


def unregister_host_memory(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)
