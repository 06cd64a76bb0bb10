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


def test_int8_rows_round_each_row_to_its_own_scale(monkeypatch):
    # quantized in chunks of rows (the 8B head's float32 copy would be 2.1 GB at once): a chunk boundary inside
    # the weight must not change a row; every code within half a step of its weight; a zero row stays zero
    from engine.layers.linear import Int8Rows

    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(37, 48, generator=gen) * torch.rand(37, 1, generator=gen)).to(torch.float16)
    weight[5] = 0
    whole = Int8Rows.quantize(weight)
    monkeypatch.setattr(Int8Rows, "CHUNK_ROWS", 8)
    chunked = Int8Rows.quantize(weight)
    assert torch.equal(whole.qweight, chunked.qweight) and torch.equal(whole.scales, chunked.scales)
    assert whole.qweight.dtype == torch.int8 and whole.qweight.abs().max() <= 127
    assert whole.scales.shape == (37,) and whole.scales.dtype == torch.float16
    step = whole.scales.float()[:, None]
    # half a step, plus the clamp at 127 where the fp16 scale rounded below max |w| / 127 (< 2^-11 of it)
    error = (whole.qweight.float() * step - weight.float()).abs()
    assert (error <= step * (0.5 + 127 * 2**-11)).all()
    assert whole.qweight[5].eq(0).all()
    assert whole.nbytes() == 37 * 48 + 37 * 2


def test_the_head_logits_of_int8_rows_are_the_w8a16_product():
    from engine.layers.linear import Int8Rows, head_logits

    gen = torch.Generator().manual_seed(2)
    head = Int8Rows.quantize(torch.randn(40, 32, generator=gen))
    hidden = torch.randn(3, 32, generator=gen)
    logits = head_logits(Backend(use_triton=False), hidden, head)
    torch.testing.assert_close(logits, hidden @ head.dequantize().t(), atol=1e-5, rtol=1e-5)
