"""Host values to the device without waiting for the device.

A tensor built from Python values or a numpy array goes up from pageable memory, and such a copy waits for
everything queued on the stream: the whole forward. In the sampler every temperature, top-p, penalty,
logit-bias or min-tokens step made the host sit out the forward there (BENCHMARKS.md, issue 17), and so did a
copy-on-write of shared prefix blocks and every eager step's inputs. From pinned memory the copy is queued
like a kernel (torch's host allocator keeps the buffer until the copy has run).
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: list | np.ndarray, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, device=device)`` (numpy arrays keep their dtype), queued without a host wait."""
    host = torch.from_numpy(np.ascontiguousarray(values)) if isinstance(values, np.ndarray) else torch.tensor(values)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
