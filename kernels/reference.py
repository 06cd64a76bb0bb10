"""Plain-torch reference implementations of every kernel: the CPU path and the oracle for the Triton ones.

Shapes and layouts defined here are the contract the Triton kernels, the model code and the quantized
weight loaders all follow:

- KV cache per layer: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
  Token ``t`` of a request lives at slot ``block_table[t // block_size] * block_size + t % block_size``.
- A forward batch is a flat list of ``num_tokens`` new tokens from ``num_seqs`` sequences; sequence ``i``
  owns query rows ``query_start_loc[i]:query_start_loc[i+1]`` which are the *last* tokens of its context
  of ``context_lens[i]`` tokens (cached prefix + the new ones).
- Packed int4 weights (``PackedInt4``): ``qweight`` int32 ``[K // 8, N]`` in blocks of ``INT4_BLOCK`` = 64 input
  rows (K a multiple of 64): nibble ``j`` (bits 4j..4j+3) of ``qweight[8b + w, n]`` (w < 8) is the code of input
  row ``64b + 8j + w``. ``scales`` ``[K // G, N]`` and ``zeros`` ``[K // G, N]`` in the activation dtype, both
  indexed by group ``k // G``; ``w[k, n] = (code - zeros[g, n]) * scales[g, n]``. When ``perm`` is set (GPTQ
  act-order), rows were reordered at load time so that groups are contiguous: ``y = x[:, perm] @ W``.
  Why this order and not GPTQ's (nibble j of row r = input row 8r + j): a tensor-core thread's operand needs
  input rows 2q, 2q + 1, 2q + 8, 2q + 9 of every 16, which are whole words 2q and 2q + 1 here (no register
  shuffle through shared memory, BENCHMARKS.md issue 16, session 14), and a one-LOP3 unpack's half2 (nibbles j
  and j + 4) holds rows 32 apart: one 32-row group in each half. ``rows_to_blocks`` converts GPTQ's order.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with an optional fused residual add.

    x, residual: [num_tokens, hidden]; weight: [hidden].
    Returns (normed, new_residual) where new_residual = x + residual (or x when residual is None),
    matching HF Llama's ``hidden + residual`` then ``norm`` in float32.
    """
    if residual is not None:
        x = x + residual
    new_residual = x
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = (xf * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed, new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation. x: [num_tokens, 2 * inter] (gate then up) -> [num_tokens, inter]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding, as HF Llama applies it.

    positions: [num_tokens] int; q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim];
    cos_sin_cache: [max_positions, head_dim] float32, first half cos, second half sin (each head_dim // 2).
    Returns new (q, k) in the input dtype.
    """
    half = q.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()]  # [num_tokens, head_dim]
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]

    def rotate(t: torch.Tensor) -> torch.Tensor:
        tf = t.float()
        t1, t2 = tf[..., :half], tf[..., half:]
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1).to(t.dtype)

    return rotate(q), rotate(k)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write new K/V into cache slots. key/value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens].

    Slots < 0 are padding and are skipped.
    """
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        valid = slots >= 0
        slots, key, value = slots[valid], key[valid], value[valid]
    # index_copy_ on the flat [num_slots, H, D] view: advanced-index assignment is ~1000x slower on CPU
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one request. cache: [num_blocks, block_size, H, D] -> [length, H, D]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())  # [num_blocks, block_size, H, D]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked attention in float32. q: [B, kv_heads, Lq, D] (query heads of a group stacked in Lq, or
    [B, heads, Lq, D] with k/v [B, kv_heads, Lk, D] and GQA); mask: True where a key is visible."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                            scale=scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    sliding_window: int = 0) -> torch.Tensor:
    """Causal attention of a ragged batch of query chunks over their paged KV (prefill, chunked prefill, decode).

    q: [num_tokens, num_heads, head_dim]; block_tables: [num_seqs, max_blocks] int32;
    query_start_loc: [num_seqs + 1] int32; context_lens: [num_seqs] int32 (cached prefix + new tokens).
    ``sliding_window`` W > 0: a query at position p sees keys p - W < k <= p (HF's sliding window, the query
    itself included); 0: every earlier key.
    Returns [num_tokens, num_heads, head_dim] in q's dtype; softmax in float32.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    decode_rows = [i for i, n in enumerate(q_lens) if n == 1]
    batch_decodes = len(decode_rows) > 1
    if batch_decodes:  # one vectorised pass for all single-token rows (the CPU path's common case)
        rows = torch.tensor(decode_rows, device=q.device)
        token_rows = query_start_loc[:-1].long()[rows]
        decoded = paged_decode_attention(q.index_select(0, token_rows), k_cache, v_cache, block_tables[rows],
                                         context_lens[rows], scale, sliding_window)
        out.index_copy_(0, token_rows, decoded)  # (index assignment is very slow on CPU)
    for i, ctx in enumerate(lens):
        q_len = q_lens[i]
        if q_len == 0 or (q_len == 1 and batch_decodes):
            continue
        q_i = q[starts[i]:starts[i + 1]].transpose(0, 1)[None]  # [1, num_heads, q_len, D]
        k = gather_kv(k_cache, block_tables[i], ctx).transpose(0, 1)[None]  # [1, kv_heads, ctx, D]
        v = gather_kv(v_cache, block_tables[i], ctx).transpose(0, 1)[None]
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - sliding_window) if sliding_window > 0 else True)
        attn = _sdpa(q_i, k, v, visible, scale)  # [1, num_heads, q_len, D]
        out[starts[i]:starts[i + 1]] = attn[0].transpose(0, 1).to(q.dtype)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int = 0) -> torch.Tensor:
    """One query token per sequence (the last of its context). q: [num_seqs, num_heads, head_dim] -> same shape.
    ``sliding_window`` as in ``paged_attention``.

    Vectorised over the batch (this is the CPU decode path): gather every sequence's blocks into a padded
    [num_seqs, max_ctx, kv_heads, head_dim] view and mask positions past each context length. The query
    heads of one KV head's group attend as ``group`` query rows of that KV head.
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_ctx = int(context_lens.max())
    num_blocks = (max_ctx + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()  # [num_seqs, num_blocks]
    padded = num_blocks * block_size
    flat = table.reshape(-1)
    k = k_cache.index_select(0, flat).reshape(num_seqs, padded, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, flat).reshape(num_seqs, padded, num_kv_heads, head_dim).transpose(1, 2)
    # k, v: [B, kv_heads, T, D]
    qg = q.view(num_seqs, num_kv_heads, group, head_dim)  # [B, kv_heads, group, D]
    positions = torch.arange(padded, device=q.device)
    lens = context_lens.to(q.device)[:, None].long()
    visible = positions[None, :] < lens  # [B, T]
    if sliding_window > 0:
        visible &= positions[None, :] >= lens - sliding_window
    out = _sdpa(qg, k, v, visible[:, None, None, :], scale)  # [B, kv_heads, group, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


INT4_BLOCK = 64  # input rows per block of 8 packed words


def rows_to_blocks(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ's row order (nibble j of row r = input row 8r + j) [K // 8, N] int32 -> this layout, and back (the
    nibble transpose of each block of 8 words is its own inverse): nibble j of word 8b + w swaps with nibble w
    of word 8b + j. Plain int32 shifts and masks on strided views: no [K, N] codes (7B: 3.5 GB packed)."""
    words, n = qweight.shape
    if (words * 8) % INT4_BLOCK:
        raise ValueError(f"packed int4: K = {words * 8} input rows is not a multiple of {INT4_BLOCK}")
    blocks = qweight.reshape(words // 8, 8, n)  # [K // 64, word in block, N]
    out = torch.zeros_like(blocks)
    for w in range(8):
        for j in range(8):
            out[:, w] |= ((blocks[:, j] >> (4 * w)) & 0xF) << (4 * j)
    return out.reshape(words, n)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """[K // 8, N] int32 -> [K, N] int32 codes 0..15 (input row 64b + 8j + w is nibble j of word 8b + w)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)  # [8]
    codes = (rows_to_blocks(qweight)[:, None, :] >> shifts[None, :, None]) & 0xF  # [K // 8, 8, N]: row 8r + j
    return codes.reshape(-1, qweight.shape[1])


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[K, N] integer codes 0..15 (K a multiple of 64) -> [K // 8, N] int32, the inverse of ``unpack_int4``."""
    k, n = codes.shape
    c = codes.to(torch.int64).reshape(k // 8, 8, n)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    packed = (c << shifts[None, :, None]).sum(dim=1)  # [K // 8, N] in row order, fits in 32 bits unsigned
    return rows_to_blocks(torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32))


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Packed int4 -> dense [K, N] weight in the scales' dtype (see module docstring for the layout)."""
    codes = unpack_int4(qweight)  # [K, N]
    k = codes.shape[0]
    group_of_row = torch.arange(k, device=codes.device) // group_size  # [K]
    s = scales[group_of_row]  # [K, N]
    z = zeros[group_of_row]
    return ((codes.to(s.dtype) - z) * s)


X16_PLANES = 7  # int32 planes of a row of x in 16-bit fixed point for the int4 GEMV (``quantize_x16``)
X16_MAX = 32767  # a block's largest |x| maps to this


def quantize_x16(x: torch.Tensor) -> torch.Tensor:
    """One row of x [K] (or [1, K]; K a multiple of 64) -> int32 [X16_PLANES, K // 8]: x in 16-bit fixed point per
    64-row block of the packed int4 layout, in the order the one-row GEMV's integer dot reads it
    (kernels/triton/w4a16_gemv.py: nibble j of packed row 8b + w is input row 64b + 8j + w).

    x[r] = q[r] * scale[b], q = round(x / scale) with scale = max|x of block b| / X16_MAX, so every |q| <= 32767
    and the error of an element is at most half its block's step (2^-16 of the block's largest; fp16's own
    rounding is 2^-11 of the element). Plane i < 4 holds, at packed row p, the int16 pair of rows (+0, +16),
    (+8, +24), (+32, +48), (+40, +56) of p's block offset by w (low half first); planes 4 and 5 the sums of q
    over p's nibbles 0-3 (rows of the block's first 32) and 4-7; plane 6, at the block's first packed row 8b,
    its scale as fp32 bits, then at 8b + 1 and 8b + 2 the sums of q over its first and second 32 rows (so a K
    step of one block reads three scalars), zeros after."""
    k = x.numel()
    if k % INT4_BLOCK:
        raise ValueError(f"quantize_x16: K = {k} is not a multiple of {INT4_BLOCK}")
    blocks = x.reshape(k // INT4_BLOCK, INT4_BLOCK).float()  # [B, 64]
    amax = blocks.abs().amax(dim=1)  # [B]
    scale = amax / X16_MAX
    inv = torch.where(amax > 0, X16_MAX / torch.where(amax > 0, amax, 1.0), 0.0)  # as the kernels compute it
    q = torch.round(blocks * inv[:, None]).clamp(-X16_MAX, X16_MAX).to(torch.int64)  # [B, 64], to nearest even
    q = q.reshape(-1, 8, 8)  # [B, nibble j, w]: row 64b + 8j + w

    def pair(lo: int, hi: int) -> torch.Tensor:  # [B, 8]: the int16 pair (nibble lo's row, nibble hi's row)
        word = (q[:, lo] & 0xFFFF) | ((q[:, hi] & 0xFFFF) << 16)
        return torch.where(word >= 2**31, word - 2**32, word)

    sum_low, sum_high = q[:, 0:4].sum(dim=1), q[:, 4:8].sum(dim=1)  # [B, 8] each
    block = torch.zeros_like(sum_low)  # [B, 8]
    block[:, 0] = scale.view(torch.int32).to(torch.int64)
    block[:, 1], block[:, 2] = sum_low.sum(dim=1), sum_high.sum(dim=1)
    planes = [pair(0, 2), pair(1, 3), pair(4, 6), pair(5, 7), sum_low, sum_high, block]
    return torch.stack(planes).reshape(X16_PLANES, k // 8).to(torch.int32)


def dequantize_x16(x16: torch.Tensor) -> torch.Tensor:
    """The row [K] float32 that ``quantize_x16``'s planes stand for: q * scale, from the pair planes."""
    words = x16[:4].to(torch.int64).reshape(4, -1, 8)  # [pair plane, B, w]
    low = ((words & 0xFFFF) ^ 0x8000) - 0x8000  # sign-extended int16 halves
    high = (((words >> 16) & 0xFFFF) ^ 0x8000) - 0x8000
    q = torch.empty(words.shape[1], 8, 8, dtype=torch.int64, device=x16.device)  # [B, nibble j, w]
    for plane, (lo, hi) in enumerate(((0, 2), (1, 3), (4, 6), (5, 7))):
        q[:, lo], q[:, hi] = low[plane], high[plane]
    scale = x16[6].reshape(-1, 8)[:, 0].contiguous().view(torch.float32)  # [B]
    return (q.float() * scale[:, None, None]).reshape(-1)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W). x: [M, K] fp16/bf16/fp32 -> [M, N] in x's dtype."""
    if perm is not None:
        x = x[:, perm]
    w = dequantize_int4(qweight, scales.to(x.dtype), zeros.to(x.dtype), group_size)
    return x @ w


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               perm: torch.Tensor | None = None, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               normed: torch.Tensor | None = None, residual: torch.Tensor | None = None,
               next_norm: tuple[torch.Tensor, torch.Tensor] | None = None, silu: bool = False,
               rope: dict | None = None, bias: torch.Tensor | None = None, x16: torch.Tensor | None = None,
               x16_out: torch.Tensor | None = None) -> torch.Tensor:
    """One-row W4A16 matmul with the decode layer's neighbours fused, as the unfused ops compute it.

    x: [1, K]. ``norm_weight`` [K]: x is RMS-normalised first (``rms_norm(x, norm_weight, eps)[0]``). ``normed``
    [1, K] (with ``norm_weight``): ``x * norm_weight`` as a ``next_norm`` wrote it, which a kernel may read
    instead of forming it; it must be exactly that (checked here: the contract), and the result is as without it.
    ``residual`` [1, N]: returns ``residual`` with y added in place; ``next_norm`` = (weight [N], out [1, N])
    with it: ``out`` gets the new residual times ``weight`` (the next launch's ``normed``). ``silu``: the weight holds gate then up
    columns; returns ``silu_and_mul(y)`` [1, N // 2]. ``rope``: the weight is qkv; dict(positions [1],
    slot_mapping [1], cos_sin_cache, k_cache, v_cache, q_size, kv_size, head_dim; with q_norm, k_norm and eps,
    Qwen3's per-head RMSNorm of q and k first): rotary q and k, k and v written to the slot, returns q [1, q_size].
    Otherwise returns y [1, N]. ``bias`` [N] is added to y before any of these. ``x16``: the dot's row (x, or
    ``normed``) as ``quantize_x16`` gives it, which a kernel's integer dot reads (checked here: the contract; the
    product is taken from x as without it); ``x16_out`` (with ``next_norm`` or ``silu``): gets ``quantize_x16``
    of the row written for the next launch.
    """
    def matmul(row: torch.Tensor) -> torch.Tensor:
        return w4a16_matmul(row, qweight, scales, zeros, group_size, perm)

    if x16 is not None and not torch.equal(x16, quantize_x16(normed if normed is not None else x)):
        raise ValueError("one-row GEMV: x16 must be quantize_x16 of the dot's row (the previous launch's x16_out)")
    out = _fused_one_row(x, matmul, norm_weight=norm_weight, eps=eps, normed=normed, residual=residual,
                         next_norm=next_norm, silu=silu, rope=rope, bias=bias)
    if x16_out is not None:
        x16_out.copy_(quantize_x16(next_norm[1] if next_norm is not None else out))
    return out


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (qweight * row_scales[:, None])^T -> [M, N] in x's dtype: an int8 weight [N, K] (a Linear's
    own layout) with one scale per output row [N] (``Int8Rows``, the optional int8 LM head). The integer
    products are summed in fp32 and scaled once a row, as the kernels do."""
    y = torch.nn.functional.linear(x.float(), qweight.float()) * row_scales.float()
    return y.to(x.dtype)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               normed: torch.Tensor | None = None, residual: torch.Tensor | None = None,
               next_norm: tuple[torch.Tensor, torch.Tensor] | None = None, silu: bool = False,
               rope: dict | None = None, bias: torch.Tensor | None = None,
               row_scales: torch.Tensor | None = None) -> torch.Tensor:
    """``w4a16_gemv`` for a dense weight [N, K] (a Linear's own layout): x @ weight^T with the same fusions.
    row_scales [N]: the weight is int8 and ``w8a16_matmul``'s product is the GEMV's."""
    def matmul(row: torch.Tensor) -> torch.Tensor:
        if row_scales is not None:
            return w8a16_matmul(row, weight, row_scales)
        return torch.nn.functional.linear(row, weight)

    return _fused_one_row(x, matmul, norm_weight=norm_weight, eps=eps, normed=normed, residual=residual,
                          next_norm=next_norm, silu=silu, rope=rope, bias=bias)


def _fused_one_row(x: torch.Tensor, matmul, *, norm_weight, eps, normed, residual, next_norm, silu, rope,
                   bias) -> torch.Tensor:
    """The unfused ops around ``matmul`` (x [1, K] -> y [1, N] in x's dtype), as ``w4a16_gemv`` describes them."""
    if normed is not None and (norm_weight is None or not torch.equal(normed, x * norm_weight)):
        raise ValueError("one-row GEMV: normed must be x * norm_weight (the previous launch's next_norm output)")
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)[0]
    y = matmul(x)  # [1, N]
    if bias is not None:
        y = y + bias
    if residual is not None:
        residual.copy_(y + residual)
        if next_norm is not None:
            weight, out = next_norm
            out.copy_(residual * weight)
        return residual
    if silu:
        return silu_and_mul(y)
    if rope is not None:
        q_size, kv_size, head_dim = rope["q_size"], rope["kv_size"], rope["head_dim"]
        q = y[:, :q_size].view(1, q_size // head_dim, head_dim)
        k = y[:, q_size:q_size + kv_size].view(1, kv_size // head_dim, head_dim)
        v = y[:, q_size + kv_size:].reshape(1, kv_size // head_dim, head_dim)
        if rope.get("q_norm") is not None:  # Qwen3: each q and k head RMS-normalized before rotary
            q = rms_norm(q.reshape(-1, head_dim), rope["q_norm"], rope["eps"])[0].view(q.shape)
            k = rms_norm(k.reshape(-1, head_dim), rope["k_norm"], rope["eps"])[0].view(k.shape)
        q, k = rotary_embedding(rope["positions"], q, k, rope["cos_sin_cache"])
        reshape_and_cache(k, v, rope["k_cache"], rope["v_cache"], rope["slot_mapping"])
        return q.reshape(1, q_size)
    return y


def masked_logits(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """A new ``logits`` [rows, vocab] with each row's disallowed tokens at -inf.

    ``bits`` [rows, words] int32 is a packed grammar mask: bit ``i % 32`` of word ``i // 32`` set when token ``i``
    is allowed; tokens past ``32 * words`` are disallowed.
    """
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).view(bits.shape[0], -1)  # [rows, words * 32]
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return logits.masked_fill(allowed[:, :vocab] == 0, float("-inf"))

