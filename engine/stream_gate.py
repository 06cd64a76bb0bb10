"""Hold a CUDA stream until the host opens a gate, so work that reads host data can be queued before the data exists.

A constrained step samples through its grammar masks, which the mask thread computes while the engine's thread
queues the forward and does the previous step's text (engine/model_runner.py). Queuing the sampling only once the
masks were ready put the sampler's host work and its device time after the grammar work, on the step's critical
path. With a gate the sampling is queued with the forward: the stream waits on a pinned host word
(``cuStreamWaitValue32``, a stream memory operation of the driver: the device waits without a spinning kernel)
until it holds the step's ticket, which the mask thread writes once the masks are written; the copies and kernels
queued behind the wait then read the finished masks.

Tickets count up; the wait is the driver's cyclic ``>=``, so wrap-around is harmless. A ticket taken must be
opened (``try``/``finally`` on the thread that writes the data): a stream held forever stalls the device.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch

log = logging.getLogger("pagoda.stream_gate")

_CU_STREAM_WAIT_VALUE_GEQ = 0x0  # wait until (int32_t)(*addr - value) >= 0


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
    """One pinned ticket word and the driver call that makes a stream wait for it; see the module docstring."""

    def __init__(self, driver: _Driver, device: torch.device):
        self._driver, self._device = driver, device
        self._word = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # [1], the last ticket opened
        self._host_word = self._word.numpy()
        address = ctypes.c_uint64()
        status = driver.device_pointer(ctypes.byref(address), ctypes.c_void_p(self._word.data_ptr()), 0)
        if status != 0:
            raise RuntimeError(f"cuMemHostGetDevicePointer failed ({status})")
        self._device_address = address.value
        self._last_ticket = 0

    @classmethod
    def for_device(cls, device: torch.device) -> StreamGate | None:
        """A gate for ``device``'s streams, or None where there is none (not CUDA, no driver entry point, a
        device without stream memory operations): the caller then waits on the host instead."""
        if device.type != "cuda":
            return None
        driver = _Driver.load()
        if driver is None:
            return None
        try:
            with torch.cuda.device(device):
                gate = cls(driver, device)
                gate.open(gate.hold(gate.take()))  # one round trip proves the driver accepts the wait
                torch.cuda.current_stream(device).synchronize()
        except RuntimeError as exc:
            log.info("no stream gate on %s (%s): constrained steps sample once their masks are ready", device, exc)
            return None
        return gate

    def take(self) -> int:
        """A new ticket (not yet waited for, not yet open)."""
        self._last_ticket = (self._last_ticket + 1) % 2**31
        return self._last_ticket

    def hold(self, ticket: int) -> int:
        """Queue, on the device's current stream, a wait until ``ticket`` is open; returns the ticket."""
        stream = torch.cuda.current_stream(self._device).cuda_stream
        status = self._driver.wait_value(ctypes.c_void_p(stream), self._device_address, ticket,
                                         _CU_STREAM_WAIT_VALUE_GEQ)
        if status != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed ({status})")
        return ticket

    def open(self, ticket: int) -> None:
        """Let the work queued behind ``ticket``'s wait run (the host's writes before this are visible to it)."""
        self._host_word[0] = np.int32(ticket)
