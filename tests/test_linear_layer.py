"""The Linear layer's packed-int4 paths agree: CPU dequantize-once (with act-order perm) vs the W4A16 reference."""

from __future__ import annotations

import torch

from engine.layers.linear import Linear, PackedInt4
from kernels import reference as R
from kernels.ops import Backend


def test_cpu_dense_cache_matches_w4a16_reference_with_perm():
    gen = torch.Generator().manual_seed(0)
    k, n, g = 64, 24, 16
    codes = torch.randint(0, 16, (k, n), generator=gen)
    scales = torch.rand(k // g, n, generator=gen) + 0.05
    zeros = torch.randint(0, 16, (k // g, n), generator=gen).float()
    perm = torch.randperm(k, generator=gen)
    packed = PackedInt4(R.pack_int4(codes), scales, zeros, g, perm)
    layer = Linear([packed], None, Backend(use_triton=False))
    x = torch.randn(5, k, generator=gen)
    expected = R.w4a16_matmul(x, packed.qweight, scales, zeros, g, perm)
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)  # cached second call
