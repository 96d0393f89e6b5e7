"""Decode attention over the paged KV cache, with RoPE and the KV-cache write fused in.

One decode step gives each sequence one new token. For every (sequence, KV head, key split) one
program loads the step's fused q/k/v row, applies RoPE (and Qwen3's q/k norm) in registers, writes the
new key and value into the sequence's cache slot (split 0 only), and attends the GQA group's query
heads to the cached keys, read in place through the block table: no gather of the context into a
padded copy, and nothing about the context length is baked into the launch, so one CUDA graph per
batch size serves every length. Long contexts are split along the key axis over several programs
whose partial results are merged by log-sum-exp in a second small kernel. At one row each program's
first tile of cached keys is in flight before it waits for the QKV projection (prefetch_keys).

Step metadata is one int32 matrix per step, `meta` [B, 3 + max_blocks]: token id, position, cache
slot, then the sequence's block table. A padding row has position 0, the scratch slot and block 0:
it attends only to itself.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from o3edge.engine.kernels import INTERPRET, pdl

META_TOKEN, META_POS, META_SLOT, META_TABLE = 0, 1, 2, 3


@triton.jit
def _rope_rows(x_ptr, rows, row_mask, d, cos, sin, HD: tl.constexpr, w_ptr, eps, NORM: tl.constexpr,
               dtype: tl.constexpr):  # d: [HD_PAD] with d >= HD masked off
    """Rows of head vectors at x_ptr + rows*HD: optional RMSNorm, then rotate-half RoPE; float32 out."""
    half: tl.constexpr = HD // 2
    mask = row_mask[:, None] & (d < HD)[None, :]
    x = tl.load(x_ptr + rows[:, None] * HD + d[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = (d + half) % HD  # rotate_half(x)[i] = -x[i + half] for i < half, x[i - half] after
    xr = tl.load(x_ptr + rows[:, None] * HD + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        w = tl.load(w_ptr + d, mask=d < HD, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HD + eps)
        x = (x * rstd[:, None]).to(dtype).to(tl.float32) * w[None, :]
        x = x.to(dtype).to(tl.float32)
        wr = tl.load(w_ptr + partner, mask=d < HD, other=0.0).to(tl.float32)
        xr = (xr * rstd[:, None]).to(dtype).to(tl.float32) * wr[None, :]
        xr = xr.to(dtype).to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)
    return (x * cos[None, :] + sign[None, :] * xr * sin[None, :]).to(dtype)


@triton.jit
def attend_range(q, m, l_sum, acc, start, end, table, k_cache_ptr, v_cache_ptr, stride_slot, kvh, sm_scale, d,
                 HD: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, dtype,
                 INTERPRET: tl.constexpr, SCORES: tl.constexpr = False, score_row=None, g=None, g_mask=None,
                 score_stride=0):
    """Online softmax over keys start .. end, BLOCK_N a tile, read through the block table. SCORES: each
    key's scaled score is also stored at score_row (store_scores; the router's observing step in splits)."""
    if INTERPRET:  # the interpreter cannot take a tensor as a range bound; compiled code pipelines a for
        n0 = start
        while n0 < end:
            m, l_sum, acc = _attend_block(q, m, l_sum, acc, n0, end, table, k_cache_ptr, v_cache_ptr, stride_slot,
                                          kvh, sm_scale, d, HD, KV_BLOCK, BLOCK_N, IEEE, dtype, SCORES, score_row, g,
                                          g_mask, score_stride)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m, l_sum, acc = _attend_block(q, m, l_sum, acc, n0, end, table, k_cache_ptr, v_cache_ptr, stride_slot,
                                          kvh, sm_scale, d, HD, KV_BLOCK, BLOCK_N, IEEE, dtype, SCORES, score_row, g,
                                          g_mask, score_stride)
    return m, l_sum, acc


@triton.jit
def _attend_block(q, m, l_sum, acc, n0, end, table, k_cache_ptr, v_cache_ptr, stride_slot, kvh, sm_scale, d,
                  HD: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, dtype,
                  SCORES: tl.constexpr = False, score_row=None, g=None, g_mask=None, score_stride=0):
    """Online softmax over keys n0 .. n0+BLOCK_N (those below end), read through the block table."""
    offs, n_mask, s, v = paged_scores(q, n0, end, table, k_cache_ptr, v_cache_ptr, stride_slot, kvh, d, HD,
                                      KV_BLOCK, BLOCK_N, IEEE)
    s = tl.where(n_mask[None, :], s * sm_scale, float("-inf"))  # [G_PAD, BLOCK_N]
    if SCORES:
        store_scores(score_row, offs, n_mask, s, g, g_mask, score_stride)
    return softmax_step(s, v, m, l_sum, acc, IEEE, dtype)


@triton.jit
def store_scores(row, idx, mask, s, g, g_mask, stride):
    """Scores s [G_PAD, N] of the GQA group's heads at row + head * stride + idx (keys off mask left alone)."""
    tl.store(row + g[:, None] * stride + idx[None, :], s, mask=g_mask[:, None] & mask[None, :])


@triton.jit
def paged_tile(n0, end, table, k_cache_ptr, v_cache_ptr, stride_slot, kvh, d, HD: tl.constexpr,
               KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys n0 .. n0+BLOCK_N (those below end) of one KV head, read in place through a block table: (their
    positions, which are below end, keys and values [BLOCK_N, HD_PAD], 0 past end)."""
    offs = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs < end
    blk = tl.load(table + offs // KV_BLOCK, mask=n_mask, other=0).to(tl.int64)
    src = (blk * KV_BLOCK + offs % KV_BLOCK) * stride_slot + kvh * HD
    kv_mask = n_mask[:, None] & (d < HD)[None, :]
    k = tl.load(k_cache_ptr + src[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, HD_PAD]
    v = tl.load(v_cache_ptr + src[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return offs, n_mask, k, v


@triton.jit
def tile_scores(q, k, IEEE: tl.constexpr):
    """q·k scores [rows, keys] of queries [rows, HD_PAD] and keys [keys, HD_PAD], unscaled."""
    if IEEE:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


@triton.jit
def paged_scores(q, n0, end, table, k_cache_ptr, v_cache_ptr, stride_slot, kvh, d, HD: tl.constexpr,
                 KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """paged_tile's keys n0 .. n0+BLOCK_N: (their positions, q·k scores [rows, BLOCK_N] unscaled, values)."""
    offs, n_mask, k, v = paged_tile(n0, end, table, k_cache_ptr, v_cache_ptr, stride_slot, kvh, d, HD, KV_BLOCK,
                                    BLOCK_N)
    return offs, n_mask, tile_scores(q, k, IEEE), v


@triton.jit
def softmax_weights(s, m, l_sum, MAYBE_EMPTY: tl.constexpr = False):
    """One tile of an online softmax's bookkeeping: scores s [rows, keys] (masked: -inf) -> the new running
    max and sum, the tile's weights p [rows, keys] and the factor alpha [rows] the values so far are scaled
    by. Every row has seen a key by its first tile, unless MAYBE_EMPTY (a key split that may start past a
    row's position): then a row that has seen none keeps sum 0 and max -inf."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_ref = m_new
    if MAYBE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_ref[:, None])
    alpha = tl.exp(m - m_ref)
    return m_new, l_sum * alpha + tl.sum(p, axis=1), p, alpha


@triton.jit
def softmax_step(s, v, m, l_sum, acc, IEEE: tl.constexpr, dtype, MAYBE_EMPTY: tl.constexpr = False, v_scale=None):
    """One tile of an online softmax (softmax_weights): scores s [rows, keys] (masked: -inf), values v
    [keys, hd] -> the running max, sum and weighted values (0 for a row that has seen no key, with
    MAYBE_EMPTY). v_scale [keys]: each value row is v_scale times v (compressed values' codes)."""
    m_new, l_sum, p, alpha = softmax_weights(s, m, l_sum, MAYBE_EMPTY)
    pv = p
    if v_scale is not None:
        pv = p * v_scale[None, :]
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(pv.to(dtype), v)
    return m_new, l_sum, acc


@triton.jit
def _decode_attention_kernel(
        qkv_ptr, stride_qkv, cos_ptr, sin_ptr, meta_ptr, stride_meta,
        k_cache_ptr, v_cache_ptr, stride_slot, qn_ptr, kn_ptr, eps,
        out_ptr, stride_out, part_o_ptr, part_lse_ptr, sm_scale,
        H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr,
        HD_PAD: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        QK_NORM: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
        PREFETCH: tl.constexpr):
    pdl.launch_next(PDL)
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dtype = k_cache_ptr.dtype.element_ty
    meta = meta_ptr + b * stride_meta
    d, g, g_mask = head_ranges(HD_PAD, G_PAD, G)
    # of the pos keys cached before the new token (meta is written before the step's first kernel)
    start, end = split_range(tl.load(meta + 1), split, NUM_SPLITS, BLOCK_N)
    if PREFETCH:  # the split's first tile of cached keys is no kernel's output: in flight before the wait
        offs, n_mask, k0, v0 = paged_tile(start, end, meta + 3, k_cache_ptr, v_cache_ptr, stride_slot, kvh, d, HD,
                                          KV_BLOCK, BLOCK_N)
    _, q, k_new, v_new = new_token(qkv_ptr + b * stride_qkv, meta, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
                                   stride_slot, kvh, split, d, g, g_mask, qn_ptr, kn_ptr, eps, H, KVH, G, HD,
                                   QK_NORM, PDL, dtype)
    m, l_sum, acc = softmax_init(G_PAD, HD_PAD)
    if PREFETCH:  # (an empty split's tile is all masked: MAYBE_EMPTY)
        s = tl.where(n_mask[None, :], tile_scores(q, k0, IEEE) * sm_scale, float("-inf"))
        m, l_sum, acc = softmax_step(s, v0, m, l_sum, acc, IEEE, dtype, True)
        start += BLOCK_N
    m, l_sum, acc = attend_range(q, m, l_sum, acc, start, end, meta + 3, k_cache_ptr, v_cache_ptr, stride_slot, kvh,
                                 sm_scale, d, HD, KV_BLOCK, BLOCK_N, IEEE, dtype, INTERPRET)
    if split == 0:  # the new token attends to itself
        m, l_sum, acc = attend_self(q, k_new, v_new, m, l_sum, acc, sm_scale)
    store_rows(acc, l_sum, m, out_ptr + b * stride_out, part_o_ptr, part_lse_ptr, (b * H + kvh * G + g) * NUM_SPLITS
               + split, kvh * G + g, g_mask, d, HD, NUM_SPLITS, dtype)


@triton.jit
def split_range(n, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """[start, end) of n keys for one of NUM_SPLITS key splits, in whole tiles of BLOCK_N."""
    chunk = tl.cdiv(tl.cdiv(n, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    return start, tl.minimum(start + chunk, n)


@triton.jit
def softmax_init(G_PAD: tl.constexpr, HD_PAD: tl.constexpr):
    """An empty online softmax: running max, sum and weighted values of G_PAD rows."""
    return (tl.full([G_PAD], float("-inf"), tl.float32), tl.zeros([G_PAD], tl.float32),
            tl.zeros([G_PAD, HD_PAD], tl.float32))


@triton.jit
def head_ranges(HD_PAD: tl.constexpr, G_PAD: tl.constexpr, G: tl.constexpr):
    """A decode-attention program's index vectors: head dimension [HD_PAD], GQA group [G_PAD] and its mask."""
    g = tl.arange(0, G_PAD)
    return tl.arange(0, HD_PAD), g, g < G


@triton.jit
def new_token(row, meta, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, stride_slot, kvh, split, d, g, g_mask, qn_ptr,
              kn_ptr, eps, H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, HD: tl.constexpr,
              QK_NORM: tl.constexpr, PDL: tl.constexpr, dtype: tl.constexpr):
    """The step's token for one KV head: its position, its GQA group's queries [G_PAD, HD_PAD] and its
    key [1, HD_PAD] (optional q/k norm, then RoPE) and value, read from its fused QKV row; split 0 writes
    the key and value into the token's cache slot (meta's third column). The position and its RoPE
    rows are read before waiting for the QKV projection (meta is written before the step's first kernel)."""
    d_mask = d < HD
    pos = tl.load(meta + 1)
    cos = tl.load(cos_ptr + pos * HD + d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * HD + d, mask=d_mask, other=0.0).to(tl.float32)
    pdl.wait_for_previous(PDL)  # q, k, v are the QKV projection's output
    q = _rope_rows(row, kvh * G + g, g_mask, d, cos, sin, HD, qn_ptr, eps, QK_NORM, dtype)
    one = tl.arange(0, 1)
    k_new = _rope_rows(row + (H + kvh) * HD, one, one < 1, d, cos, sin, HD, kn_ptr, eps, QK_NORM, dtype)
    new_mask = (one < 1)[:, None] & d_mask[None, :]
    v_new = tl.load(row + (H + KVH + kvh) * HD + d[None, :] + one[:, None] * 0, mask=new_mask, other=0.0)
    if split == 0:
        slot = tl.load(meta + 2).to(tl.int64)
        dst = slot * stride_slot + kvh * HD + one[:, None] * 0 + d[None, :]
        tl.store(k_cache_ptr + dst, k_new, mask=new_mask)
        tl.store(v_cache_ptr + dst, v_new, mask=new_mask)
    return pos, q, k_new, v_new


@triton.jit
def attend_self(q, k_new, v_new, m, l_sum, acc, sm_scale):
    """The online softmax's step for the new token's own key and value."""
    s_self = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * sm_scale  # [G_PAD]
    m_new = tl.maximum(m, s_self)
    alpha = tl.exp(m - m_new)
    p_self = tl.exp(s_self - m_new)
    return m_new, l_sum * alpha + p_self, acc * alpha[:, None] + p_self[:, None] * v_new.to(tl.float32)


@triton.jit
def store_rows(acc, l_sum, m, out_row, part_o_ptr, part_lse_ptr, part, heads, g_mask, d, HD: tl.constexpr,
               NUM_SPLITS: tl.constexpr, dtype: tl.constexpr):
    """A program's heads: their output (one split), or this split's normalized partial output and
    log-sum-exp at rows `part` (a row without keys: 0 and -inf, weight 0 in the merge)."""
    mask = g_mask[:, None] & (d < HD)[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_row + heads[:, None] * HD + d[None, :], (acc / l_sum[:, None]).to(dtype), mask=mask)
    else:
        has = l_sum > 0
        o = tl.where(has[:, None], acc / tl.where(has, l_sum, 1.0)[:, None], 0.0)
        lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
        tl.store(part_o_ptr + part[:, None] * HD + d[None, :], o, mask=mask)
        tl.store(part_lse_ptr + part, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, stride_out, H: tl.constexpr, HD: tl.constexpr,
                         HD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                         PDL: tl.constexpr):
    pdl.launch_next(PDL)
    pdl.wait_for_previous(PDL)
    """One (row, head): the splits' partial outputs weighted by their share of the softmax mass. A split
    without keys has lse -inf (weight 0, its partial output not read: prefill leaves a padding row's
    unwritten); a row whose splits all have none (prefill's padding) gets 0."""
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HD_PAD)
    base = (b.to(tl.int64) * H + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + s, mask=s < NUM_SPLITS, other=float("-inf"))  # [S]
    top = tl.max(lse, axis=0)
    w = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))  # 0 for -inf
    o = tl.load(part_o_ptr + (base + s)[:, None] * HD + d[None, :], mask=(w > 0)[:, None] & (d < HD)[None, :],
                other=0.0)  # [S, HD_PAD]
    den = tl.sum(w, axis=0)
    out = tl.sum(o * w[:, None], axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * stride_out + h * HD + d, out.to(out_ptr.dtype.element_ty), mask=d < HD)


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, block_size: int,
                     num_splits: int = 1, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                     eps: float = 1e-6, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """qkv: [B, (H + 2*KVH) * hd] this step's projections; cos, sin: [max_len, hd] tables;
    meta: int32 [B, 3 + max_blocks]; k_cache, v_cache: [slots, KVH, hd] (written at each row's slot).
    Returns the attention output [B, H * hd]. config (BLOCK_N, num_warps, num_stages) overrides the
    tiling (tools/bench_attention.py)."""
    B = qkv.shape[0]
    _, KVH, HD = k_cache.shape
    G = num_heads // KVH
    out, part_o, part_lse = split_outputs(qkv, num_heads, HD, num_splits, k_cache.dtype)
    norm = q_norm is not None
    on = pdl.enabled(str(qkv.device))
    block_n, warps, stages = config or (key_tile(HD), 4, 2)
    _decode_attention_kernel[(B, KVH, num_splits)](
        qkv, qkv.stride(0), cos, sin, meta, meta.stride(0), k_cache, v_cache, k_cache.stride(0),
        q_norm if norm else cos, k_norm if norm else cos, eps, out, out.stride(0), part_o, part_lse, HD ** -0.5,
        H=num_heads, KVH=KVH, G=G, G_PAD=max(16, triton.next_power_of_2(G)), HD=HD,
        HD_PAD=max(16, triton.next_power_of_2(HD)), KV_BLOCK=block_size,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, QK_NORM=norm,
        IEEE=k_cache.dtype == torch.float32, INTERPRET=INTERPRET, PDL=on, PREFETCH=prefetch_keys(B),
        num_warps=warps, num_stages=stages, **pdl.launch_options(on))
    return merge_splits(out, part_o, part_lse, num_splits, on)


def prefetch_keys(rows: int) -> bool:
    """Whether a decode-attention program loads its first tile of cached keys and values before it waits for
    the QKV projection (programmatic dependent launch, kernels/pdl.py): the block-table lookup and the tile's
    round trip to memory then overlap the projection's tail instead of following it. At one row, where the
    projection is o3edge's own streamed kernel (launched with PDL). Above, the projection is cuBLAS's (no
    overlap to gain) and the prefetch cost time. On the H200 (tools/profile_gpu_step.py, tinyllama-1.1b
    fp16, graph replay; docs/results/gpu-2026-12-03/): batch 1 0.784 -> 0.749 ms a step (every linear INT4
    0.560 -> 0.544), batch 8 1.104 -> 1.164. `O3EDGE_ATTN_PREFETCH=0` never prefetches (to measure against)."""
    return rows == 1 and os.environ.get("O3EDGE_ATTN_PREFETCH") != "0"


def key_tile(head_dim: int) -> int:
    """Keys a decode-attention tile: 64 (32 above head_dim 128, for registers). On the H200, llama-1b,
    16 sequences at 4,096 tokens (tools/bench_attention.py, docs/results/gpu-2026-12-01c/attn-grid.json),
    64-key tiles took a layer's attention from 80.8 to 56.9 us at 3 key splits and from 47.6 to 40.7 us
    at 12: more bytes in flight a load (the kernel is bound by memory latency, not by its math)."""
    return 64 if head_dim <= 128 else 32


def split_outputs(qkv: torch.Tensor, num_heads: int, head_dim: int, num_splits: int, dtype: torch.dtype):
    """(output [B, H * hd], and with key splits their partial outputs [B, H, splits, hd] and log-sum-exps
    [B, H, splits] in float32; without, the output again in their place)."""
    B = qkv.shape[0]
    out = torch.empty(B, num_heads * head_dim, device=qkv.device, dtype=dtype)
    if num_splits == 1:
        return out, out, out
    return (out, torch.empty(B, num_heads, num_splits, head_dim, device=qkv.device, dtype=torch.float32),
            torch.empty(B, num_heads, num_splits, device=qkv.device, dtype=torch.float32))


def merge_splits(out: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor, num_splits: int,
                 pdl_on: bool) -> torch.Tensor:
    """out [rows, H * HD], with the key splits' partial results [rows, H, splits, HD] and log-sum-exps
    merged into it (a second small kernel) when there are several. Decode and prefill attention both."""
    if num_splits > 1:
        B, H, _, HD = part_o.shape
        _merge_splits_kernel[(B, H)](part_o, part_lse, out, out.stride(0), H=H, HD=HD,
                                     HD_PAD=triton.next_power_of_2(HD), NUM_SPLITS=num_splits,
                                     SPLITS_PAD=triton.next_power_of_2(num_splits), PDL=pdl_on, num_warps=2,
                                     **pdl.launch_options(pdl_on))
    return out


def decode_attention_reference(qkv, cos, sin, meta, k_cache, v_cache, num_heads, block_size,
                               q_norm=None, k_norm=None, eps=1e-6):
    """Plain torch, one sequence at a time: what decode_attention computes (and writes)."""
    from o3edge.engine.rope import apply_rope

    B = qkv.shape[0]
    _, KVH, HD = k_cache.shape
    qkv = qkv.view(B, num_heads + 2 * KVH, HD)
    outs = []
    for b in range(B):
        token, pos, slot = meta[b, :3].tolist()
        q, k, v = qkv[b, :num_heads], qkv[b, num_heads:num_heads + KVH], qkv[b, num_heads + KVH:]
        if q_norm is not None:
            q, k = _rms(q, q_norm, eps), _rms(k, k_norm, eps)
        q = apply_rope(q[None], cos[pos:pos + 1], sin[pos:pos + 1])[0]
        k = apply_rope(k[None], cos[pos:pos + 1], sin[pos:pos + 1])[0]
        k_cache[slot], v_cache[slot] = k, v
        keys = torch.arange(pos + 1, device=meta.device)
        slots = meta[b, 3 + keys // block_size].long() * block_size + keys % block_size
        kk, vv = k_cache[slots].float(), v_cache[slots].float()  # [S, KVH, hd]
        kk = kk.repeat_interleave(num_heads // KVH, dim=1)
        vv = vv.repeat_interleave(num_heads // KVH, dim=1)
        att = torch.softmax(torch.einsum("hd,shd->hs", q.float(), kk) * HD ** -0.5, dim=-1)
        outs.append(torch.einsum("hs,shd->hd", att, vv).reshape(-1).to(k_cache.dtype))
    return torch.stack(outs)


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
