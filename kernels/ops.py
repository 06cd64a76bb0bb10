"""The op table the model calls: picks the Triton kernel for CUDA tensors and the torch reference otherwise.

Every function here has the signature and semantics of its namesake in ``kernels/reference.py``.
``Backend`` is an object (not module state) so two engines in one process can choose differently,
e.g. a test forcing the reference path on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import reference


def triton_available() -> bool:
    """True when Triton imports and a CUDA device is present (or TRITON_INTERPRET=1 is set for tests)."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 (a broken Triton install raises more than ImportError; torch still runs)
        return False
    return torch.cuda.is_available()


@dataclass(frozen=True)
class Backend:
    """Which implementation each op uses. ``use_triton`` False means the plain-torch reference everywhere.

    ``triton_ops`` narrows Triton to the named ops (e.g. ``frozenset({"rms_norm"})``), the rest use the
    reference: bench/numerics.py uses it to find which kernel moves the logits. None means every op.
    """

    use_triton: bool
    triton_ops: frozenset[str] | None = None

    @staticmethod
    def for_device(device: torch.device | str, force_reference: bool = False) -> Backend:
        dev = torch.device(device)
        return Backend(use_triton=(dev.type == "cuda" and not force_reference and triton_available()))

    @property
    def impl(self):
        if self.use_triton:
            from kernels import triton_ops
            return triton_ops
        return reference

    def _for(self, op: str):
        if self.triton_ops is not None and op not in self.triton_ops:
            return reference
        return self.impl

    def rms_norm(self, x, weight, eps, residual=None):
        return self._for("rms_norm").rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x):
        return self._for("silu_and_mul").silu_and_mul(x)

    def rotary_embedding(self, positions, q, k, cos_sin_cache):
        return self._for("rotary_embedding").rotary_embedding(positions, q, k, cos_sin_cache)

    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping):
        return self._for("reshape_and_cache").reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention(self, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                        sliding_window=0):
        return self._for("paged_attention").paged_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                                            context_lens, scale, sliding_window)

    def paged_decode_attention(self, q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=0):
        return self._for("paged_decode_attention").paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                                          context_lens, scale, sliding_window)

    def w4a16_matmul(self, x, qweight, scales, zeros, group_size, perm=None):
        return self._for("w4a16_matmul").w4a16_matmul(x, qweight, scales, zeros, group_size, perm)

    def w4a16_gemv(self, x, qweight, scales, zeros, group_size, perm=None, **fused):
        return self._for("w4a16_gemv").w4a16_gemv(x, qweight, scales, zeros, group_size, perm, **fused)

    def dense_gemv(self, x, weight, **fused):
        return self._for("dense_gemv").dense_gemv(x, weight, **fused)

    def w8a16_matmul(self, x, qweight, row_scales):
        return self._for("w8a16_matmul").w8a16_matmul(x, qweight, row_scales)

    def masked_logits(self, logits, bits):
        return self._for("masked_logits").masked_logits(logits, bits)

