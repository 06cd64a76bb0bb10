"""Plain-torch reference implementations of every kernel: the CPU path and the oracle for the Triton ones.

Shapes and layouts defined here are the contract the Triton kernels, the model code and the quantized
weight loaders all follow:

- KV cache per layer: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
  Token ``t`` of a request lives at slot ``block_table[t // block_size] * block_size + t % block_size``.
- A forward batch is a flat list of ``num_tokens`` new tokens from ``num_seqs`` sequences; sequence ``i``
  owns query rows ``query_start_loc[i]:query_start_loc[i+1]`` which are the *last* tokens of its context
  of ``context_lens[i]`` tokens (cached prefix + the new ones).
- Packed int4 weights (``PackedInt4``): ``qweight`` int32 ``[K // 8, N]``, nibble ``j`` (bits 4j..4j+3) of
  ``qweight[r, n]`` is the code of input row ``8r + j``; ``scales`` ``[K // G, N]`` and ``zeros`` ``[K // G, N]``
  in the activation dtype, both indexed by group ``k // G``; ``w[k, n] = (code - zeros[g, n]) * scales[g, n]``.
  When ``perm`` is set (GPTQ act-order), rows were reordered at load time so that groups are contiguous:
  ``y = x[:, perm] @ W``.
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
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[valid].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[valid].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one request. cache: [num_blocks, block_size, H, D] -> [length, H, D]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, H, D]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a ragged batch of query chunks over their paged KV (prefill, chunked prefill, decode).

    q: [num_tokens, num_heads, head_dim]; block_tables: [num_seqs, max_blocks] int32;
    query_start_loc: [num_seqs + 1] int32; context_lens: [num_seqs] int32 (cached prefix + new tokens).
    Returns [num_tokens, num_heads, head_dim] in q's dtype; softmax in float32.
    """
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    decode_rows = [i for i, n in enumerate(q_lens) if n == 1]
    if len(decode_rows) > 1:  # one vectorised pass for all single-token rows (the CPU path's common case)
        rows = torch.tensor(decode_rows, device=q.device)
        token_rows = query_start_loc[:-1].long()[rows]
        out[token_rows] = paged_decode_attention(q[token_rows], k_cache, v_cache, block_tables[rows],
                                                 context_lens[rows], scale)
    for i, ctx in enumerate(lens):
        q_i = q[starts[i]:starts[i + 1]].float()  # [q_len, H, D]
        q_len = q_i.shape[0]
        if q_len == 0 or (q_len == 1 and len(decode_rows) > 1):
            continue
        k = gather_kv(k_cache, block_tables[i], ctx).float().repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = gather_kv(v_cache, block_tables[i], ctx).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_i, k) * scale  # [H, q_len, ctx]
        q_pos = torch.arange(ctx - q_len, ctx, device=scores.device)[:, None]
        k_pos = torch.arange(ctx, device=scores.device)[None, :]
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence. q: [num_seqs, num_heads, head_dim] -> same shape.

    Vectorised over the batch (this is the CPU decode path): gather every sequence's blocks into a padded
    [num_seqs, max_ctx, kv_heads, head_dim] view and mask positions past each context length.
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_ctx = int(context_lens.max())
    num_blocks = (max_ctx + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()  # [num_seqs, num_blocks]
    k = k_cache[table].reshape(num_seqs, num_blocks * block_size, num_kv_heads, head_dim).float()
    v = v_cache[table].reshape(num_seqs, num_blocks * block_size, num_kv_heads, head_dim).float()
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,btkd->bkgt", qg, k) * scale  # [num_seqs, kv_heads, group, max_ctx_padded]
    positions = torch.arange(num_blocks * block_size, device=q.device)
    pad = positions[None, :] >= context_lens.to(q.device)[:, None].long()  # [num_seqs, max_ctx_padded]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("bkgt,btkd->bkgd", probs, v)  # [num_seqs, kv_heads, group, head_dim]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """[K // 8, N] int32 -> [K, N] int32 codes 0..15 (nibble j of row r is input row 8r + j)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)  # [8]
    codes = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF  # [K // 8, 8, N]
    return codes.reshape(-1, qweight.shape[1])


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[K, N] integer codes 0..15 -> [K // 8, N] int32, the inverse of ``unpack_int4``."""
    k, n = codes.shape
    c = codes.to(torch.int64).reshape(k // 8, 8, n)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    packed = (c << shifts[None, :, None]).sum(dim=1)  # [K // 8, N], fits in 32 bits unsigned
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Packed int4 -> dense [K, N] weight in the scales' dtype (see module docstring for the layout)."""
    codes = unpack_int4(qweight)  # [K, N]
    k = codes.shape[0]
    group_of_row = torch.arange(k, device=codes.device) // group_size  # [K]
    s = scales[group_of_row]  # [K, N]
    z = zeros[group_of_row]
    return ((codes.to(s.dtype) - z) * s)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W). x: [M, K] fp16/bf16/fp32 -> [M, N] in x's dtype."""
    if perm is not None:
        x = x[:, perm]
    w = dequantize_int4(qweight, scales.to(x.dtype), zeros.to(x.dtype), group_size)
    return x @ w
