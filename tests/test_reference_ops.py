"""The torch reference ops (the CPU path and the kernels' oracle) against dense textbook formulas."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference as R


def dense_causal_attention(q, k, v, scale, window=0):
    """q: [q_len, H, D] as the last q_len of ctx positions; k, v: [ctx, H_kv, D]. Plain float64 formula;
    ``window`` W > 0: the query at pos sees keys pos - W + 1 .. pos (HF's sliding window)."""
    q_len, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    out = torch.zeros(q_len, heads, q.shape[2], dtype=torch.float64)
    for t in range(q_len):
        pos = ctx - q_len + t
        for h in range(heads):
            lo = max(0, pos - window + 1) if window > 0 else 0
            scores = (k[lo: pos + 1, h] @ q[t, h].double()) * scale
            weights = torch.softmax(scores, dim=0)
            out[t, h] = weights @ v[lo: pos + 1, h]
    return out


def random_paged_batch(gen, q_lens, ctx_lens, heads=4, kv_heads=2, dim=16, block=4, num_blocks=64):
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen)
    max_blocks = max(math.ceil(c / block) for c in ctx_lens)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: len(ctx_lens) * max_blocks].view(len(ctx_lens), max_blocks).int()
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    starts = torch.tensor([0] + list(torch.cumsum(torch.tensor(q_lens), 0)), dtype=torch.int32)
    return q, k_cache, v_cache, tables, starts, torch.tensor(ctx_lens, dtype=torch.int32)


def test_paged_attention_matches_dense_formula():
    gen = torch.Generator().manual_seed(1)
    q_lens, ctx_lens = [5, 1, 3, 1, 1], [5, 9, 14, 1, 22]  # prefill, decodes, a chunk over a cached prefix
    q, kc, vc, tables, starts, ctx = random_paged_batch(gen, q_lens, ctx_lens)
    out = R.paged_attention(q, kc, vc, tables, starts, ctx, scale=0.25)
    for i, (q_len, c) in enumerate(zip(q_lens, ctx_lens)):
        k = R.gather_kv(kc, tables[i], c)
        v = R.gather_kv(vc, tables[i], c)
        expected = dense_causal_attention(q[starts[i]:starts[i + 1]], k, v, 0.25)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]].double(), expected, atol=1e-5, rtol=1e-5)


def test_reshape_and_cache_writes_only_its_slots():
    gen = torch.Generator().manual_seed(2)
    kc = torch.full((8, 4, 2, 8), float("nan"))
    vc = torch.full((8, 4, 2, 8), float("nan"))
    key, value = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([13, 2, -1, 30, 7])
    R.reshape_and_cache(key, value, kc, vc, slots)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(kc[slot // 4, slot % 4], key[i]) and torch.equal(vc[slot // 4, slot % 4], value[i])
    assert int((~kc.isnan()).sum()) == 4 * 2 * 8


def test_int4_pack_roundtrip_and_matmul():
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (64, 24), generator=gen)
    assert torch.equal(R.unpack_int4(R.pack_int4(codes)), codes.int())
    scales, zeros = torch.rand(2, 24, generator=gen) + 0.1, torch.randint(0, 16, (2, 24), generator=gen).float()
    w = (codes.float() - zeros.repeat_interleave(32, 0)) * scales.repeat_interleave(32, 0)
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(R.w4a16_matmul(x, R.pack_int4(codes), scales, zeros, 32), x @ w)


def test_int4_layout_is_blocks_of_64_rows_and_converts_from_gptq_row_order():
    """The packed layout the kernels read: nibble j of word 8b + w is input row 64b + 8j + w; ``rows_to_blocks``
    turns GPTQ's order (nibble j of word r is row 8r + j) into it and back; K must be whole blocks."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (128, 6), generator=gen)
    packed = R.pack_int4(codes)
    for b, w, j in [(0, 0, 0), (0, 3, 5), (1, 7, 7), (1, 2, 4)]:
        assert torch.equal((packed[8 * b + w] >> (4 * j)) & 0xF, codes[64 * b + 8 * j + w].int())
    gptq = torch.zeros(16, 6, dtype=torch.int64)  # row order, built independently of the code under test
    for r in range(16):
        for j in range(8):
            gptq[r] |= codes[8 * r + j].long() << (4 * j)
    gptq = torch.where(gptq >= 2**31, gptq - 2**32, gptq).to(torch.int32)
    assert torch.equal(R.rows_to_blocks(gptq), packed)
    assert torch.equal(R.rows_to_blocks(packed), gptq)
    with pytest.raises(ValueError, match="multiple of 64"):
        R.rows_to_blocks(torch.zeros(4, 6, dtype=torch.int32))  # K = 32


def test_paged_attention_sliding_window_matches_dense_formula():
    gen = torch.Generator().manual_seed(2)
    q_lens, ctx_lens = [12, 1, 4, 1, 1], [12, 9, 14, 3, 22]  # windows shorter and longer than the contexts
    q, kc, vc, tables, starts, ctx = random_paged_batch(gen, q_lens, ctx_lens)
    for window in (1, 4, 10):
        out = R.paged_attention(q, kc, vc, tables, starts, ctx, scale=0.25, sliding_window=window)
        for i, (q_len, c) in enumerate(zip(q_lens, ctx_lens)):
            k = R.gather_kv(kc, tables[i], c)
            v = R.gather_kv(vc, tables[i], c)
            expected = dense_causal_attention(q[starts[i]:starts[i + 1]], k, v, 0.25, window)
            torch.testing.assert_close(out[starts[i]:starts[i + 1]].double(), expected, atol=1e-5, rtol=1e-5)
    full = R.paged_attention(q, kc, vc, tables, starts, ctx, scale=0.25)
    assert not torch.allclose(full, R.paged_attention(q, kc, vc, tables, starts, ctx, 0.25, sliding_window=4))
