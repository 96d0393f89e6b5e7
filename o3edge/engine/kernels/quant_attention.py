"""Decode attention over the token router's compressed KV pool: a partial result and its log-sum-exp.

One program per (sequence, KV head) walks the sequence's compressed blocks (a row of block ids and a
count, so nothing about the context is baked into a launch), dequantizes each block's codes in
registers with its per-(token, head) scales, and runs an online softmax for the GQA group's query
heads. The storage type is a compile-time switch: BITS=8 reads int8 codes, BITS=4 reads two codes a
byte (low nibble first). It returns the partial output (divided by its own softmax sum) and the
log-sum-exp per head, which the caller merges with the full-precision pool's
partial result (engine/router.py). With INT4 the caller passes queries rotated by the Hadamard
matrix and rotates the output back. Keys and values are in the layout of `KVRouter.codes`/`scales`
for one layer: codes [2 (K/V), slots, KVH, code_dim], scales [2, slots, KVH] float16.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _load_dequant(codes_ptr, scales_ptr, slot, n_mask, kvh, d, stride_slot, stride_head, s_slot, s_head,
                  HD: tl.constexpr, BITS: tl.constexpr):
    """[BLOCK_N, HD_PAD] float32 vectors of the given slots (rows outside n_mask: 0)."""
    mask = n_mask[:, None] & (d < HD)[None, :]
    base = slot[:, None] * stride_slot + kvh * stride_head
    if BITS == 8:
        q = tl.load(codes_ptr + base + d[None, :], mask=mask, other=0).to(tl.float32)
    else:
        byte = tl.load(codes_ptr + base + (d // 2)[None, :], mask=mask, other=0).to(tl.int32)
        nib = (byte >> ((d % 2) * 4)[None, :]) & 0xF
        q = tl.where(nib > 7, nib - 16, nib).to(tl.float32)
    s = tl.load(scales_ptr + slot * s_slot + kvh * s_head, mask=n_mask, other=0.0).to(tl.float32)
    return q * s[:, None]


@triton.jit
def _attend_qblock(q, m, l_sum, acc, blk, k_codes, v_codes, k_scales, v_scales, kvh, d, stride_slot, stride_head,
                   s_slot, s_head, sm_scale, HD: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                   BITS: tl.constexpr):
    offs = tl.arange(0, BLOCK_N)
    n_mask = offs < KV_BLOCK
    slot = blk.to(tl.int64) * KV_BLOCK + offs
    k = _load_dequant(k_codes, k_scales, slot, n_mask, kvh, d, stride_slot, stride_head, s_slot, s_head, HD, BITS)
    v = _load_dequant(v_codes, v_scales, slot, n_mask, kvh, d, stride_slot, stride_head, s_slot, s_head, HD, BITS)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    s = tl.where(n_mask[None, :], s * sm_scale, float("-inf"))  # [G_PAD, BLOCK_N]
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l_sum, acc


@triton.jit
def _quant_attention_kernel(q_ptr, stride_qb, table_ptr, stride_tb, count_ptr, k_codes, v_codes, k_scales, v_scales,
                            stride_slot, stride_head, s_slot, s_head, o_ptr, lse_ptr, sm_scale,
                            H: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr,
                            HD_PAD: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr,
                            INTERPRET: tl.constexpr):
    b, kvh = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, HD_PAD)
    g = tl.arange(0, G_PAD)
    heads = kvh * G + g
    qmask = (g < G)[:, None] & (d < HD)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * HD + d[None, :], mask=qmask, other=0.0).to(tl.float32)
    n = tl.load(count_ptr + b)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HD_PAD], tl.float32)
    if INTERPRET:  # the interpreter cannot take a tensor as a range bound
        j = 0
        while j < n:
            blk = tl.load(table_ptr + b * stride_tb + j)
            m, l_sum, acc = _attend_qblock(q, m, l_sum, acc, blk, k_codes, v_codes, k_scales, v_scales, kvh, d,
                                           stride_slot, stride_head, s_slot, s_head, sm_scale, HD, KV_BLOCK,
                                           BLOCK_N, BITS)
            j += 1
    else:
        for j in range(0, n):
            blk = tl.load(table_ptr + b * stride_tb + j)
            m, l_sum, acc = _attend_qblock(q, m, l_sum, acc, blk, k_codes, v_codes, k_scales, v_scales, kvh, d,
                                           stride_slot, stride_head, s_slot, s_head, sm_scale, HD, KV_BLOCK,
                                           BLOCK_N, BITS)
    has = l_sum > 0
    o = tl.where(has[:, None], acc / tl.where(has, l_sum, 1.0)[:, None], 0.0)
    lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
    tl.store(o_ptr + (b * H + heads)[:, None] * HD + d[None, :], o, mask=qmask)
    tl.store(lse_ptr + b * H + heads, lse, mask=g < G)


def quant_attention_partial(q: torch.Tensor, table: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                            mode: str, block_size: int, counts: torch.Tensor | None = None):
    """q: [B, H, hd] float32 (int4: rotated); table: int32 [B, max_blocks] compressed block ids per row,
    the first counts[b] of them used (None: all); codes [2, slots, KVH, cd], scales [2, slots, KVH].
    Returns (o [B, H, hd] float32, lse [B, H] float32; a row with no blocks: o 0, lse -inf)."""
    B, H, HD = q.shape
    _, _, KVH, _ = codes.shape
    if counts is None:
        counts = torch.full((B,), table.shape[1], dtype=torch.int32, device=q.device)
    q = q.contiguous().float()
    o = torch.empty(B, H, HD, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, H, device=q.device, dtype=torch.float32)
    G = H // KVH
    _quant_attention_kernel[(B, KVH)](
        q, q.stride(0), table, table.stride(0), counts, codes[0], codes[1], scales[0], scales[1],
        codes.stride(1), codes.stride(2), scales.stride(1), scales.stride(2), o, lse, HD ** -0.5,
        H=H, G=G, G_PAD=max(16, triton.next_power_of_2(G)), HD=HD, HD_PAD=max(16, triton.next_power_of_2(HD)),
        KV_BLOCK=block_size, BLOCK_N=max(16, triton.next_power_of_2(block_size)), BITS=8 if mode == "int8" else 4,
        INTERPRET=INTERPRET, num_warps=4)
    return o, lse


def quant_attention_reference(q, table, codes, scales, mode, block_size, counts=None):
    """Dequantize, then attend, in plain torch: what quant_attention_partial computes."""
    from o3edge.engine.kv_quant import dequantize

    B, H, HD = q.shape
    KVH = codes.shape[2]
    o = torch.zeros(B, H, HD, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(B):
        n = table.shape[1] if counts is None else int(counts[b])
        if n == 0:
            continue
        blocks = table[b, :n].long()
        slots = (blocks[:, None] * block_size + torch.arange(block_size, device=q.device)).reshape(-1)
        k = dequantize(codes[0, slots], scales[0, slots], mode).repeat_interleave(H // KVH, dim=1)  # [S, H, hd]
        v = dequantize(codes[1, slots], scales[1, slots], mode).repeat_interleave(H // KVH, dim=1)
        s = torch.einsum("hd,shd->hs", q[b].float(), k) * HD ** -0.5
        lse[b] = torch.logsumexp(s, -1)
        o[b] = torch.einsum("hs,shd->hd", torch.softmax(s, -1), v)
    return o, lse
