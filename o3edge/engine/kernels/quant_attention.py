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

from o3edge.engine.kernels import INTERPRET, pdl
from o3edge.engine.kernels.decode_attention import (attend_range, attend_self, head_ranges, key_tile, new_token,
                                                     paged_scores, softmax_init, softmax_step, softmax_weights,
                                                     split_range,
                                                     store_rows, store_scores)
from o3edge.engine.kernels.gemv import offset_half



@triton.jit
def _load_codes(codes_ptr, slot, n_mask, kvh, d, stride_slot, stride_head, HD: tl.constexpr, BITS: tl.constexpr,
                MAGIC: tl.constexpr = False):
    """[BLOCK_N, HD_PAD] codes of the given slots as signed integers in float32 (rows outside n_mask: 0).
    MAGIC: in float16, converted through half-precision bit patterns (gemv.offset_half) instead of
    int-to-float."""
    mask = n_mask[:, None] & (d < HD)[None, :]
    base = slot[:, None] * stride_slot + kvh * stride_head
    if BITS == 8:
        byte = tl.load(codes_ptr + base + d[None, :], mask=mask, other=0)
        if MAGIC:  # two's complement: the byte's value + 128 is its bits with the top one flipped
            q = offset_half((byte.to(tl.int32) & 0xFF) ^ 0x80, 128)
        else:
            q = byte.to(tl.float32)
    elif HD == d.shape[0]:  # each byte loaded once, its two codes interleaved back (low nibble first)
        half = tl.arange(0, HD // 2)
        byte = tl.load(codes_ptr + base + half[None, :], mask=n_mask[:, None], other=0).to(tl.int32)
        lo, hi = byte & 0xF, (byte >> 4) & 0xF
        if MAGIC:
            lo, hi = offset_half(lo ^ 8, 8), offset_half(hi ^ 8, 8)
        else:
            lo, hi = tl.where(lo > 7, lo - 16, lo).to(tl.float32), tl.where(hi > 7, hi - 16, hi).to(tl.float32)
        q = tl.reshape(tl.join(lo, hi), [byte.shape[0], HD])
    else:
        byte = tl.load(codes_ptr + base + (d // 2)[None, :], mask=mask, other=0).to(tl.int32)
        nib = (byte >> ((d % 2) * 4)[None, :]) & 0xF
        if MAGIC:
            q = offset_half(nib ^ 8, 8)
        else:
            q = tl.where(nib > 7, nib - 16, nib).to(tl.float32)
    return q



@triton.jit
def _load_scales(scales_ptr, slot, n_mask, kvh, s_slot, s_head):
    """[BLOCK_N] float32 scales of the given slots (rows outside n_mask: 0)."""
    return tl.load(scales_ptr + slot * s_slot + kvh * s_head, mask=n_mask, other=0.0).to(tl.float32)


@triton.jit
def _load_dequant(codes_ptr, scales_ptr, slot, n_mask, kvh, d, stride_slot, stride_head, s_slot, s_head,
                  HD: tl.constexpr, BITS: tl.constexpr):
    """[BLOCK_N, HD_PAD] float32 vectors of the given slots (rows outside n_mask: 0)."""
    q = _load_codes(codes_ptr, slot, n_mask, kvh, d, stride_slot, stride_head, HD, BITS)
    return q * _load_scales(scales_ptr, slot, n_mask, kvh, s_slot, s_head)[:, None]


@triton.jit
def _cblock_slots(j, j_end, table, KV_BLOCK: tl.constexpr, NB: tl.constexpr, CBLOCK_N: tl.constexpr):
    """Compressed blocks table[j .. j+NB) (those before j_end) as one tile of CBLOCK_N >= NB * KV_BLOCK keys:
    (their mask, their slots)."""
    offs = tl.arange(0, CBLOCK_N)
    bi = j + offs // KV_BLOCK
    n_mask = (offs < NB * KV_BLOCK) & (bi < j_end)
    blk = tl.load(table + bi, mask=n_mask, other=0)
    return n_mask, blk.to(tl.int64) * KV_BLOCK + offs % KV_BLOCK


@triton.jit
def _cblock_scores(q, j, j_end, table, k_codes, k_scales, kvh, d, stride_slot, stride_head, s_slot, s_head, sm_scale,
                   HD: tl.constexpr, KV_BLOCK: tl.constexpr, NB: tl.constexpr, CBLOCK_N: tl.constexpr,
                   BITS: tl.constexpr, IEEE: tl.constexpr, dtype: tl.constexpr, SCALE_AFTER: tl.constexpr = False):
    """Compressed blocks table[j .. j+NB) (those before j_end) in one tile of CBLOCK_N >= NB * KV_BLOCK keys:
    (their mask, their slots, scaled scores [rows, CBLOCK_N], -inf off the mask). Key offs of the tile is
    the sequence's compressed key j * KV_BLOCK + offs. Off IEEE, the dequantized keys meet the query on
    the tensor cores in the cache's dtype, as the full-precision keys do. SCALE_AFTER: the codes themselves
    (integers, exact in float16 and bfloat16) meet the query, and each key's score is scaled after the dot
    (a multiply a key instead of one a key element)."""
    n_mask, slot = _cblock_slots(j, j_end, table, KV_BLOCK, NB, CBLOCK_N)
    if SCALE_AFTER:
        k = _load_codes(k_codes, slot, n_mask, kvh, d, stride_slot, stride_head, HD, BITS, True)
        k_scale = _load_scales(k_scales, slot, n_mask, kvh, s_slot, s_head) * sm_scale
    else:
        k = _load_dequant(k_codes, k_scales, slot, n_mask, kvh, d, stride_slot, stride_head, s_slot, s_head, HD,
                          BITS)
        k_scale = tl.full([CBLOCK_N], sm_scale, tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q.to(dtype), tl.trans(k.to(dtype)))
    return n_mask, slot, tl.where(n_mask[None, :], s * k_scale[None, :], float("-inf"))


@triton.jit
def _attend_cblocks(q, m, l_sum, acc, j, j_end, table, k_codes, v_codes, k_scales, v_scales, kvh, d, stride_slot,
                    stride_head, s_slot, s_head, sm_scale, HD: tl.constexpr, KV_BLOCK: tl.constexpr, NB: tl.constexpr,
                    CBLOCK_N: tl.constexpr, BITS: tl.constexpr, IEEE: tl.constexpr, dtype: tl.constexpr,
                    SCALE_AFTER: tl.constexpr = False, SCORES: tl.constexpr = False, score_row=None, g=None,
                    g_mask=None, score_stride=0):
    """The online softmax over compressed blocks table[j .. j+NB) (_cblock_scores); off IEEE the
    probabilities meet the dequantized values on the tensor cores in the cache's dtype. SCALE_AFTER: the
    probabilities are scaled by each key's value scale and meet the value codes themselves. SCORES: the
    scaled scores are also stored at score_row (store_scores), at the compressed keys' places."""
    n_mask, slot, s = _cblock_scores(q, j, j_end, table, k_codes, k_scales, kvh, d, stride_slot, stride_head, s_slot,
                                     s_head, sm_scale, HD, KV_BLOCK, NB, CBLOCK_N, BITS, IEEE, dtype, SCALE_AFTER)
    if SCORES:
        store_scores(score_row, j * KV_BLOCK + tl.arange(0, CBLOCK_N), n_mask, s, g, g_mask, score_stride)
    if SCALE_AFTER:
        v = _load_codes(v_codes, slot, n_mask, kvh, d, stride_slot, stride_head, HD, BITS, True)
        v_scale = _load_scales(v_scales, slot, n_mask, kvh, s_slot, s_head)
        return softmax_step(s, v.to(tl.float32) if IEEE else v.to(dtype), m, l_sum, acc, IEEE, dtype,
                            v_scale=v_scale)
    v = _load_dequant(v_codes, v_scales, slot, n_mask, kvh, d, stride_slot, stride_head, s_slot, s_head, HD, BITS)
    return softmax_step(s, v if IEEE else v.to(dtype), m, l_sum, acc, IEEE, dtype)


@triton.jit
def _attend_halves(qe, qo, m, l_sum, acc_e, acc_o, j, j_end, table, k_codes, v_codes, k_scales, v_scales, kvh,
                   stride_slot, stride_head, s_slot, s_head, sm_scale, HD: tl.constexpr, KV_BLOCK: tl.constexpr,
                   NB: tl.constexpr, CBLOCK_N: tl.constexpr):
    """_attend_cblocks for INT4 codes with fast_codes, the codes never interleaved back: a byte's low nibble is
    an even dimension, its high nibble the next odd one, so the scores are the even half of the (rotated)
    query against the low nibbles plus its odd half against the high ones (two tensor-core dots of HD / 2),
    and the values' even and odd dimensions are two accumulators, joined once after the last tile."""
    n_mask, slot = _cblock_slots(j, j_end, table, KV_BLOCK, NB, CBLOCK_N)
    half = tl.arange(0, HD // 2)
    base = slot[:, None] * stride_slot + kvh * stride_head + half[None, :]
    k = tl.load(k_codes + base, mask=n_mask[:, None], other=0).to(tl.int32)
    s = tl.dot(qe, tl.trans(offset_half((k & 0xF) ^ 8, 8)))
    s = tl.dot(qo, tl.trans(offset_half(((k >> 4) & 0xF) ^ 8, 8)), s)
    k_scale = _load_scales(k_scales, slot, n_mask, kvh, s_slot, s_head) * sm_scale
    s = tl.where(n_mask[None, :], s * k_scale[None, :], float("-inf"))
    m_new, l_sum, p, alpha = softmax_weights(s, m, l_sum)
    pv = (p * _load_scales(v_scales, slot, n_mask, kvh, s_slot, s_head)[None, :]).to(tl.float16)
    v = tl.load(v_codes + base, mask=n_mask[:, None], other=0).to(tl.int32)
    acc_e = acc_e * alpha[:, None] + tl.dot(pv, offset_half((v & 0xF) ^ 8, 8))
    acc_o = acc_o * alpha[:, None] + tl.dot(pv, offset_half(((v >> 4) & 0xF) ^ 8, 8))
    return m_new, l_sum, acc_e, acc_o


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
    m, l_sum, acc = softmax_init(G_PAD, HD_PAD)
    table = table_ptr + b * stride_tb
    if INTERPRET:  # the interpreter cannot take a tensor as a range bound
        j = 0
        while j < n:
            m, l_sum, acc = _attend_cblocks(q, m, l_sum, acc, j, n, table, k_codes, v_codes, k_scales, v_scales, kvh,
                                            d, stride_slot, stride_head, s_slot, s_head, sm_scale, HD, KV_BLOCK, 1,
                                            BLOCK_N, BITS, True, tl.float32)
            j += 1
    else:
        for j in range(0, n):
            m, l_sum, acc = _attend_cblocks(q, m, l_sum, acc, j, n, table, k_codes, v_codes, k_scales, v_scales, kvh,
                                            d, stride_slot, stride_head, s_slot, s_head, sm_scale, HD, KV_BLOCK, 1,
                                            BLOCK_N, BITS, True, tl.float32)
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


# ---- the router's whole decode attention, for the CUDA-graph decode step ------------------------------
#
# One program per (sequence, KV head, key split), as kernels/decode_attention.py: RoPE on the step's
# q/k row, the new K/V written to its slot, then attention over the sequence's full-precision keys
# (a compacted block table: every full-precision block but the last is complete, so key j sits at
# table[j // block] * block + j % block) and over its compressed blocks (dequantized in registers;
# INT4: the query rotated by the Hadamard matrix R in registers, the compressed part's output rotated
# back), merged by log-sum-exp. Router step metadata `meta` [B, 5 + 2 * max_blocks] int32: token,
# position, slot, full-precision keys before the new token, compressed blocks, the full-precision
# block table (max_blocks), the compressed block table (max_blocks, compressed block indices).
RMETA_KEYS, RMETA_COMP, RMETA_TABLE = 3, 4, 5


@triton.jit
def _add_mass(row, idx, mask, p, H: tl.constexpr):
    """row[idx] += p summed over the GQA group's heads, / H (the mean over all heads, once every KV
    head's program has added its share)."""
    w = tl.sum(p, axis=0) / H
    old = tl.load(row + idx, mask=mask, other=0.0)
    tl.store(row + idx, old + w, mask=mask)


@triton.jit
def _observe(q, qf, k_new, lse, g_mask, n_full, n_comp, meta, MAX_BLOCKS, k_cache_ptr, v_cache_ptr, stride_slot,
             k_codes, k_scales, c_slot, c_head, s_slot, s_head, kvh, d, sm_scale, c_scale, row, MASS_P, H: tl.constexpr,
             HD: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, CBLOCK_N: tl.constexpr,
             NB: tl.constexpr, BITS: tl.constexpr, IEEE: tl.constexpr, dtype: tl.constexpr):
    """Saliency observed inside the step (one key split, so lse is the row's final log-sum-exp): the
    attention probabilities exp(score - lse) the GQA group's heads give the n_full keys of the compacted
    full-precision table, the new token (full key n_full) and the n_comp compressed blocks, their sum / H
    added to the step's mass rows (row[:MASS_P]: the full-precision keys in compacted order, the new
    token after them; row[MASS_P:]: the compressed keys). The scores are those of the attention pass,
    computed again the same way."""
    n0 = n_full * 0  # a tensor: a loop counter must not change type in compiled code
    while n0 < n_full:
        offs, n_mask, s, _ = paged_scores(q, n0, n_full, meta + 5, k_cache_ptr, v_cache_ptr, stride_slot, kvh, d,
                                          HD, KV_BLOCK, BLOCK_N, IEEE)
        p = tl.where(g_mask[:, None] & n_mask[None, :], tl.exp(s * sm_scale - lse[:, None]), 0.0)
        _add_mass(row, offs, n_mask, p, H)
        n0 += BLOCK_N
    s_self = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * sm_scale  # as attend_self
    one = tl.arange(0, 1)
    p_self = tl.where(g_mask, tl.exp(s_self - lse), 0.0)
    _add_mass(row, n_full + one, one < 1, p_self[:, None], H)
    j = n_comp * 0
    while j < n_comp:
        n_mask, _, s = _cblock_scores(qf, j, n_comp, meta + 5 + MAX_BLOCKS, k_codes, k_scales, kvh, d, c_slot, c_head,
                                      s_slot, s_head, c_scale, HD, KV_BLOCK, NB, CBLOCK_N, BITS, IEEE, dtype)
        p = tl.where(g_mask[:, None] & n_mask[None, :], tl.exp(s - lse[:, None]), 0.0)
        _add_mass(row + MASS_P, j * KV_BLOCK + tl.arange(0, CBLOCK_N), n_mask, p, H)
        j += NB


@triton.jit
def _f16_range(x, sm_scale):
    """(x 2^-e, sm_scale 2^e) with e >= 0 the smallest that takes x's largest magnitude to at most 2^14: a
    query in float32 made safe for the compressed pool's float16 dots (float16 holds up to 65,504, bfloat16
    far more), its scores coming out the same. A power of two scales exactly; e is 0, nothing changes,
    for any query below 16,384."""
    top = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    e = tl.maximum(tl.ceil(tl.log2(top) - 14.0), 0.0)
    return x * tl.exp2(-e), sm_scale * tl.exp2(e)


@triton.jit
def _butterfly(x, H: tl.constexpr):
    """One stage of the fast Walsh-Hadamard transform over x's last axis: each pair of columns (i, i + H) in
    blocks of 2H becomes (sum, difference)."""
    R: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    a, b = tl.split(tl.permute(tl.reshape(x, [R, N // (2 * H), 2, H]), [0, 1, 3, 2]))
    return tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [R, N])


@triton.jit
def _rotated(x, rot_ptr, d, n_comp, HD: tl.constexpr, BITS: tl.constexpr, FWHT: tl.constexpr = False):
    """x [rows, HD_PAD] float32 in the INT4 pool's rotated basis (or back: the Hadamard matrix is its own
    inverse); a float32 dot, none for INT8 or a row with nothing compressed. FWHT (a power-of-two HD): by
    log2(HD) butterfly stages of additions instead of the [HD, HD] matrix (the normalised Sylvester one,
    kv_quant.hadamard), which holds no matrix in registers."""
    if BITS == 4:
        if n_comp > 0:
            if FWHT and HD == d.shape[0]:
                for st in tl.static_range(8):  # head dims up to 256
                    if (1 << st) < HD:
                        x = _butterfly(x, 1 << st)
                x = x / tl.sqrt(tl.full([1, 1], HD, tl.float32))
            else:
                rmask = (d < HD)[:, None] & (d < HD)[None, :]
                rot = tl.load(rot_ptr + d[:, None] * HD + d[None, :], mask=rmask, other=0.0)
                x = tl.dot(x, rot, input_precision="ieee")
    return x


@triton.jit
def _observe_scores_kernel(scores_ptr, part_lse_ptr, meta_ptr, stride_meta, mass_ptr, MASS_P, H: tl.constexpr,
                           KVH: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, KV_BLOCK: tl.constexpr,
                           NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
    """An observing step's probabilities from the scores its key splits stored: one (row, KV head, tile
    of BLOCK key places). Each head's final log-sum-exp comes from its splits' (part_lse); exp(score -
    lse) over the GQA group's heads, / H, is added to mass[row, kvh] as _observe adds it."""
    pdl.launch_next(PDL)
    pdl.wait_for_previous(PDL)
    b, kvh, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = tl.arange(0, G_PAD)
    g_mask = g < G
    heads = (b * H + kvh * G + g).to(tl.int64)
    sp = tl.arange(0, SPLITS_PAD)
    parts = tl.load(part_lse_ptr + heads[:, None] * NUM_SPLITS + sp[None, :],
                    mask=g_mask[:, None] & (sp < NUM_SPLITS)[None, :], other=float("-inf"))  # [G_PAD, S]
    top = tl.max(parts, axis=1)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(parts - top[:, None]), axis=1)  # > 0 for every real head: it has seen its own token
    lse = top + tl.log(tl.where(total > 0, total, 1.0))
    idx = t * BLOCK + tl.arange(0, BLOCK)  # a place in [full keys and the new token | compressed keys]
    n_full = tl.load(meta_ptr + b * stride_meta + 3)
    n_comp = tl.load(meta_ptr + b * stride_meta + 4)
    pool_full = idx < MASS_P
    key = tl.where(pool_full, idx, idx - MASS_P)
    valid = tl.where(pool_full, key < n_full + 1, key < n_comp * KV_BLOCK) & (idx < 2 * MASS_P)
    both = g_mask[:, None] & valid[None, :]
    s = tl.load(scores_ptr + heads[:, None] * 2 * MASS_P + idx[None, :], mask=both, other=float("-inf"))
    p = tl.where(both, tl.exp(s - lse[:, None]), 0.0)
    row = mass_ptr + (b * KVH + kvh).to(tl.int64) * 2 * MASS_P
    old = tl.load(row + idx, mask=valid, other=0.0)
    tl.store(row + idx, old + tl.sum(p, axis=0) / H, mask=valid)


@triton.jit
def joined_ranges(n_full, n_comp, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
                  WF: tl.constexpr, WC: tl.constexpr):
    """A key split's share of a row's tiles, both pools in a row: the full-precision pool's tiles of BLOCK_N
    keys (tf of them, WF a tile), then the compressed pool's of NB blocks (WC a tile), the whole cost cut
    into NUM_SPLITS equal runs [c0, c1); a tile belongs to the run its cost starts in. ([start, end) of the
    n_full full-precision keys, [j_start, j_end) of the n_comp compressed blocks; empty: end <= start.)"""
    tf = tl.cdiv(n_full, BLOCK_N)
    per = tl.cdiv(tf * WF + tl.cdiv(n_comp, NB) * WC, NUM_SPLITS)
    c0, c1 = split * per, (split + 1) * per
    return (tl.minimum(tl.cdiv(c0, WF), tf) * BLOCK_N,
            tl.minimum(tl.minimum(tl.cdiv(c1, WF), tf) * BLOCK_N, n_full),
            tl.cdiv(tl.maximum(c0 - tf * WF, 0), WC) * NB,
            tl.minimum(tl.cdiv(tl.maximum(c1 - tf * WF, 0), WC) * NB, n_comp))


@triton.jit
def _router_decode_kernel(
        qkv_ptr, stride_qkv, cos_ptr, sin_ptr, meta_ptr, stride_meta, MAX_BLOCKS,
        k_cache_ptr, v_cache_ptr, stride_slot, k_codes, v_codes, k_scales, v_scales, c_slot, c_head, s_slot, s_head,
        rot_ptr, qn_ptr, kn_ptr, eps, out_ptr, stride_out, part_o_ptr, part_lse_ptr, sm_scale, mass_ptr, MASS_P,
        scores_ptr,
        H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr,
        HD_PAD: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, CBLOCK_N: tl.constexpr,
        NB: tl.constexpr, NUM_SPLITS: tl.constexpr, BITS: tl.constexpr, QK_NORM: tl.constexpr, IEEE: tl.constexpr,
        OBSERVE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr, FAST: tl.constexpr = False,
        SCORES: tl.constexpr = False, F16: tl.constexpr = False, HALVES: tl.constexpr = False,
        JOIN_FULL: tl.constexpr = 0, JOIN_COMP: tl.constexpr = 0):
    pdl.launch_next(PDL)  # kernels/pdl.py, as decode_attention
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dtype = k_cache_ptr.dtype.element_ty
    cdtype = dtype  # the compressed pool's tensor-core dots: in float16 with F16 (its codes are exact there)
    if F16:
        cdtype = tl.float16
    meta = meta_ptr + b * stride_meta
    n_full = tl.load(meta + 3)
    n_comp = tl.load(meta + 4)
    d, g, g_mask = head_ranges(HD_PAD, G_PAD, G)
    pos, q, k_new, v_new = new_token(qkv_ptr + b * stride_qkv, meta, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
                                     stride_slot, kvh, split, d, g, g_mask, qn_ptr, kn_ptr, eps, H, KVH, G, HD,
                                     QK_NORM, PDL, dtype)

    # this split's chunk of the compacted full-precision table and its share of the compressed blocks
    # (joined_splits: both from one run of the two pools' tiles)
    if JOIN_FULL > 0:
        start, end, j_start, j_end = joined_ranges(n_full, n_comp, split, NUM_SPLITS, BLOCK_N, NB, JOIN_FULL,
                                                   JOIN_COMP)
    else:
        start, end = split_range(n_full, split, NUM_SPLITS, BLOCK_N)
        per = tl.cdiv(n_comp, NUM_SPLITS)
        j_start = split * per
        j_end = tl.minimum(j_start + per, n_comp)
    m, l_sum, acc = softmax_init(G_PAD, HD_PAD)
    # SCORES (an observing step in key splits): each key's scaled score by head, for _observe_scores_kernel
    score_row = scores_ptr + (b * H + kvh * G).to(tl.int64) * 2 * MASS_P
    m, l_sum, acc = attend_range(q, m, l_sum, acc, start, end, meta + 5, k_cache_ptr, v_cache_ptr, stride_slot, kvh,
                                 sm_scale, d, HD, KV_BLOCK, BLOCK_N, IEEE, dtype, INTERPRET, SCORES, score_row, g,
                                 g_mask, 2 * MASS_P)
    if split == 0:  # the new token attends to itself
        m, l_sum, acc = attend_self(q, k_new, v_new, m, l_sum, acc, sm_scale)
        if SCORES:  # its score as attend_self makes it, after the full keys
            s_self = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * sm_scale
            one = tl.arange(0, 1)
            store_scores(score_row, n_full + one, one < 1, s_self[:, None], g, g_mask, 2 * MASS_P)

    # the compressed blocks: this split's share of them (INT4: the query in the rotated basis)
    n_mine = tl.maximum(j_end - j_start, 0)  # compressed blocks this program attends to
    qf = _rotated(q.to(tl.float32), rot_ptr, d, n_mine, HD, BITS, FAST)
    c_scale = sm_scale  # the compressed pool's score scale
    if F16:
        qf, c_scale = _f16_range(qf, sm_scale)
    m_c, l_c, acc_c = softmax_init(G_PAD, HD_PAD)
    ctable = meta + 5 + MAX_BLOCKS
    c_row = score_row + MASS_P  # with SCORES: the compressed keys' scores after the full ones
    if HALVES:  # INT4, fast codes, float16 dots, HD a power of 2 (_attend_halves)
        qe, qo = tl.split(tl.reshape(qf, [G_PAD, HD_PAD // 2, 2]))
        qe, qo = qe.to(tl.float16), qo.to(tl.float16)
        acc_e = tl.zeros([G_PAD, HD_PAD // 2], tl.float32)
        acc_o = tl.zeros([G_PAD, HD_PAD // 2], tl.float32)
        j = j_start
        while j < j_end:  # NB blocks a tile (a while loop: the interpreter takes no tensor as a range bound)
            m_c, l_c, acc_e, acc_o = _attend_halves(qe, qo, m_c, l_c, acc_e, acc_o, j, j_end, ctable, k_codes,
                                                    v_codes, k_scales, v_scales, kvh, c_slot, c_head, s_slot,
                                                    s_head, c_scale, HD, KV_BLOCK, NB, CBLOCK_N)
            j += NB
        acc_c = tl.reshape(tl.join(acc_e, acc_o), [G_PAD, HD_PAD])
    elif INTERPRET:
        j = j_start
        while j < j_end:  # NB blocks a tile
            m_c, l_c, acc_c = _attend_cblocks(qf, m_c, l_c, acc_c, j, j_end, ctable, k_codes, v_codes, k_scales,
                                              v_scales, kvh, d, c_slot, c_head, s_slot, s_head, c_scale, HD,
                                              KV_BLOCK, NB, CBLOCK_N, BITS, IEEE, cdtype, FAST, SCORES, c_row, g,
                                              g_mask, 2 * MASS_P)
            j += NB
    else:
        for j in range(j_start, j_end, NB):
            m_c, l_c, acc_c = _attend_cblocks(qf, m_c, l_c, acc_c, j, j_end, ctable, k_codes, v_codes, k_scales,
                                              v_scales, kvh, d, c_slot, c_head, s_slot, s_head, c_scale, HD,
                                              KV_BLOCK, NB, CBLOCK_N, BITS, IEEE, cdtype, FAST, SCORES, c_row, g,
                                              g_mask, 2 * MASS_P)
    acc_c = _rotated(acc_c, rot_ptr, d, n_mine, HD, BITS, FAST)  # back from the rotated basis

    # merge the two pools: one (output, log-sum-exp) per row
    m_all = tl.maximum(m, m_c)
    has = m_all > float("-inf")
    m_safe = tl.where(has, m_all, 0.0)
    w_f = tl.where(l_sum > 0, tl.exp(m - m_safe), 0.0)
    w_c = tl.where(l_c > 0, tl.exp(m_c - m_safe), 0.0)
    l_all = l_sum * w_f + l_c * w_c
    acc_all = acc * w_f[:, None] + acc_c * w_c[:, None]
    if OBSERVE:  # one split: this program has seen every key, so the final lse is known
        _observe(q, qf, k_new, m_safe + tl.log(tl.where(l_all > 0, l_all, 1.0)), g_mask, n_full, n_comp, meta,
                 MAX_BLOCKS, k_cache_ptr, v_cache_ptr, stride_slot, k_codes, k_scales, c_slot, c_head,
                 s_slot, s_head, kvh, d, sm_scale, c_scale, mass_ptr + (b * KVH + kvh) * 2 * MASS_P, MASS_P, H, HD,
                 KV_BLOCK, BLOCK_N, CBLOCK_N, NB, BITS, IEEE, cdtype)
    store_rows(acc_all, l_all, m_safe, out_ptr + b * stride_out, part_o_ptr, part_lse_ptr,
               (b * H + kvh * G + g) * NUM_SPLITS + split, kvh * G + g, g_mask, d, HD, NUM_SPLITS, dtype)


def fast_codes() -> bool:
    """Whether the router's decode kernel runs its second-round code paths (the default; O3EDGE_ROUTER_FAST=0
    turns them off, to measure against): compressed keys' and values' codes multiplied on the tensor cores
    as they are (exact in float16 and bfloat16), converted through half-precision bit patterns, their scales
    applied to the scores and to the probabilities (a multiply a key instead of one a key element;
    _cblock_scores); and INT4's Hadamard rotation of the query and output by butterflies instead of a
    float32 matrix product (_rotated). Compiled for sm_90 (tools/kernel_sass.py router, llama-1b at 4K x 16,
    bf16): INT8 161 -> 128 registers, no int-to-float conversions; INT4 255 registers and 136 bytes spilled
    -> 160 registers, none spilled. On the H200 (tools/bench_attention.py, llama-1b, 4K x 16, every sealed
    block compressed; docs/results/gpu-2026-12-01f/router/): INT8 48.96 -> 46.18 us a layer (full-precision
    decode attention over bf16 K/V: 46.24), INT4 92.22 -> 57.34."""
    return os.environ.get("O3EDGE_ROUTER_FAST") != "0"


def f16_dots() -> bool:
    """Whether the compressed pool's tensor-core dots run in float16 whatever the cache's dtype (with
    fast_codes; O3EDGE_ROUTER_F16=0 keeps the cache's dtype). The codes converted through half-precision
    bit patterns are float16 already and exact there; in bfloat16 each was widened to float32 and rounded
    again, two conversions an element. The query (bfloat16) is exact in float16 within its range, and the
    probabilities times the value scales keep more bits than in bfloat16. Compiled for sm_90
    (tools/kernel_sass.py router, llama-1b at 4K x 16, bf16): INT8 2,464 -> 2,248 instructions (no F2FP;
    HADD2 208 -> 80) but 128 -> 140 registers, INT4 2,896 -> 2,728 and 160 -> 140; hence register_cap. The
    query is taken into float16's range first (_f16_range), as it is for a float16 cache's dots."""
    return os.environ.get("O3EDGE_ROUTER_F16", "1") != "0"


def halves_int4() -> bool:
    """Whether INT4's compressed tiles run as two halves (_attend_halves: even and odd coordinates, each a
    float16 dot of half the head dimension, two value accumulators joined once) instead of interleaving the
    codes back into one tile (O3EDGE_ROUTER_HALVES=0). Taken where the codes are fast, the dots float16
    and the head dimension a power of 2. On the H200 (tools/bench_attention.py --cases int4, llama-1b,
    16 sequences at 4,096 tokens, bf16, every sealed block INT4; docs/results/gpu-2026-12-03/a2/) a layer
    took 51.3 us interleaved and 40.3 in halves, against 43.0 for full-precision bf16 K/V."""
    return os.environ.get("O3EDGE_ROUTER_HALVES", "1") != "0"


def joined_splits(fine: bool = False) -> tuple[int, int]:
    """(a full-precision tile's cost, a compressed tile's), or (0, 0): whether a row's key splits share its tiles
    of both pools in a row: (1, 1) with fine tiles (fine_tiles), else not; O3EDGE_ROUTER_JOINED=WF,WC (1 for
    1,1; 0 for off) sets it for every launch (a measurement switch). The full-precision
    pool's tiles of BLOCK_N keys, then the compressed pool's of NB blocks, weighted by those costs, are cut
    into equal runs, one a split, so that only the split where one pool ends and the other starts reads both.
    Otherwise (the default) every split takes a share of each pool: two loops, each with its own first load
    to wait for, and the compressed share counted in blocks, not tiles (at 11 blocks a split and 8 a tile, a
    second tile three eighths full). On an H100 (call 1 of
    docs/results/gpu-2026-12-05d/, the trained model at 16 x 3,840, 73% of its keys compressed; graph replay,
    tools/bench_router.py --gpu --shape model) the router's step took 0.327 ms joined (1,1) against
    0.334-0.336, 0.325 with 64 compressed keys a tile; alone (tools/bench_attention.py --shape ref-long,
    call 2), half the blocks compressed, 15.3 us a layer against 12.5: a program's three 128-key compressed
    tiles take longer than two full-precision tiles and one compressed. Weighted (2,3) or at 80 registers it
    gained nothing alone or in whole decode (docs/results/gpu-2026-12-05e/call1/); with 64-key compressed tiles
    it did (fine_tiles)."""
    text = os.environ.get("O3EDGE_ROUTER_JOINED", "1" if fine else "0")
    if text in ("", "0"):
        return 0, 0
    if text == "1":
        return 1, 1
    wf, wc = text.split(",")
    return int(wf), int(wc)


FINE_SPLITS = 16  # key splits from which a row's share a program is a few tiles (fine_tiles)


def fine_tiles(num_splits: int, observe: bool) -> bool:
    """Whether a decode launch (not an observing one) in FINE_SPLITS key splits or more takes compressed
    tiles of 64 keys and its splits joined across the two pools (joined_splits), instead of 128-key tiles and
    each split a share of each pool (O3EDGE_ROUTER_FINE=0 keeps those, 1 takes fine tiles at any split count).
    Many splits leave each program a few hundred keys of a row: at the trained model's 16 x 3,840 (2 KV
    heads, 16 splits, 73% of the blocks compressed) each program read up to two full-precision tiles and two
    compressed ones (8 blocks and 3); joined 64-key tiles give every program about as many tiles as the
    full-precision kernel's. On an H100 (tools/bench_attention.py --shape ref-long --batch 16 --context 3840
    --cases off,int8-0.73,int4-0.73; docs/results/gpu-2026-12-05f/call4/ and call5/, two machines): INT8
    15.62-15.74 -> 12.81-13.0 us a layer, INT4 15.9 -> 13.84 (full precision 13.1); the router's GPU step
    (tools/bench_router.py --gpu --shape model) 0.333-0.334 -> 0.320-0.324 ms (full precision 0.300-0.306).
    llama-1b at 2 x 4,096 (32 splits) is unchanged (INT8 10.88 -> 10.96). With few splits (llama-1b at
    16 x 4,096: 4) each program walks a thousand keys and the longer tile wins (the comment in
    router_decode_attention). INT8 and INT4 alike."""
    text = os.environ.get("O3EDGE_ROUTER_FINE")
    if text in ("0", "1"):
        return text == "1" and not observe
    return num_splits >= FINE_SPLITS and not observe


def register_cap(observe: bool) -> dict:
    """Launch options capping the router kernel's registers at 104 a thread (O3EDGE_ROUTER_MAXNREG=R: R, 0:
    none), so that four programs of four warps fit an SM (router_graph.router_attention_per_sm), INT4's
    too (160 uncapped: three). Compiled for sm_90 it spills 24 bytes in INT8 and 8 in INT4; the observing
    variants (a refresh step's, one in 32) would spill 72-288, and are not capped. On the H200
    (tools/bench_attention.py --splits 3,4,5,6,8, llama-1b at 16 x 4,096, bf16; full precision 45.7 us a
    layer at its 9 splits; docs/results/gpu-2026-12-02k/attention/), µs a layer at the best split:
    INT8 41.3 (4 splits) before, 44.0 (3) with float16 dots uncapped, 39.5 (4) with the cap at 104;
    INT4 57.8 (3) before, 54.3 (3) float16 dots, 50.0 (4) capped at 104 (96: 51.0 at 8, 128: 53.2 at 4)."""
    cap = os.environ.get("O3EDGE_ROUTER_MAXNREG", "104")
    return {"maxnreg": int(cap)} if cap.isdigit() and int(cap) > 0 and not observe and not INTERPRET else {}


def router_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                            rotation: torch.Tensor | None, mode: str, num_heads: int, block_size: int,
                            num_splits: int = 1, q_norm: torch.Tensor | None = None,
                            k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                            mass: torch.Tensor | None = None, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """decode_attention (kernels/decode_attention.py) over both of the router's pools, one layer:
    qkv [B, (H + 2*KVH) * hd]; meta int32 [B, 5 + 2 * max_blocks] (the layout above); k_cache, v_cache
    [slots, KVH, hd] (written at each row's slot); codes [2, slots, KVH, cd] and scales [2, slots, KVH]
    of the layer (KVRouter.codes[layer], .scales[layer]); rotation [hd, hd] float32 for int4.
    With mass (float32 [B, KVH, 2, P]), the step also observes saliency: each key's attention
    probability, averaged over the heads, is added to mass[b, :, 0, i] for the i-th full-precision key
    in compacted order (the new token at i = full keys before it) and to mass[b, :, 1, i] for the i-th
    compressed key (summed over the KV-head axis, that is the eager router's observation: router.py
    `_observe`). In one key split each program knows its rows' final log-sum-exp and observes in a second
    pass over its keys; in several, each split stores its keys' scores by head into a scratch [B, H, 2, P]
    and a second kernel (_observe_scores_kernel) turns them into probabilities once every split's
    log-sum-exp is known (router_graph.py's observing steps, by default).
    Returns the attention output [B, H * hd]. Static shapes: it can be
    captured in a CUDA graph. config (BLOCK_N, compressed keys a tile, num_warps, num_stages) overrides the
    tiling (tools/bench_attention.py)."""
    from o3edge.engine.kernels.decode_attention import merge_splits, split_outputs

    B = qkv.shape[0]
    _, KVH, HD = k_cache.shape
    G = num_heads // KVH
    g_pad = max(16, triton.next_power_of_2(G))
    max_blocks = (meta.shape[1] - 5) // 2
    out, part_o, part_lse = split_outputs(qkv, num_heads, HD, num_splits, k_cache.dtype)
    norm = q_norm is not None
    observe = mass is not None
    if observe and (mass.shape[:3] != (B, KVH, 2) or not mass.is_contiguous()):
        raise ValueError(f"observing takes a contiguous [B, KVH, 2, P] mass, got {tuple(mass.shape)}")
    scored = observe and num_splits > 1  # the splits store scores; _observe_scores_kernel observes after
    scores = torch.empty(B, num_heads, 2, mass.shape[-1], dtype=torch.float32, device=qkv.device) if scored else cos
    rot = rotation if rotation is not None else cos
    on = pdl.enabled(str(qkv.device))
    fast = fast_codes()
    # the compressed pool's dots in float16 (the query then taken into its range: _f16_range)
    f16 = k_cache.dtype == torch.float16 or (fast and k_cache.dtype != torch.float32 and f16_dots())
    # compressed keys: 128 a tile (whole blocks) where the block size is a power of 2 up to 128, else one
    # block; on the H200 (llama-1b, 16 sequences at 4,096 tokens, 3 key splits) uniform INT8 took 71.5 us a
    # layer with 64 and 48.3 with 128, INT4 119.5 and 94.0 (tools/bench_attention.py --grid)
    # (fine_tiles: 64 and the key splits joined across the pools where a row is cut into many splits)
    pow2 = block_size & (block_size - 1) == 0
    override = config or tiling_override()
    fine = override is None and fine_tiles(num_splits, observe)
    block_n, ctile, warps, stages = override or (key_tile(HD), 64 if fine else 128, 4, 2)
    nb = max(1, ctile // block_size) if pow2 else 1
    cblock = max(16, triton.next_power_of_2(nb * block_size))
    joined = joined_splits(fine)
    _router_decode_kernel[(B, KVH, num_splits)](
        qkv, qkv.stride(0), cos, sin, meta, meta.stride(0), max_blocks, k_cache, v_cache, k_cache.stride(0),
        codes[0], codes[1], scales[0], scales[1], codes.stride(1), codes.stride(2), scales.stride(1),
        scales.stride(2), rot, q_norm if norm else cos, k_norm if norm else cos, eps, out, out.stride(0),
        part_o, part_lse, HD ** -0.5, mass if observe else cos, mass.shape[-1] if observe else 0, scores,
        H=num_heads, KVH=KVH, G=G, G_PAD=g_pad, HD=HD,
        HD_PAD=max(16, triton.next_power_of_2(HD)), KV_BLOCK=block_size,
        BLOCK_N=block_n, CBLOCK_N=cblock, NB=nb,
        NUM_SPLITS=num_splits, BITS=8 if mode == "int8" else 4, QK_NORM=norm, IEEE=k_cache.dtype == torch.float32,
        OBSERVE=observe and not scored, INTERPRET=INTERPRET, PDL=on, FAST=fast, SCORES=scored,
        F16=f16, HALVES=(mode == "int4" and fast and f16 and not observe and HD & (HD - 1) == 0
                         and halves_int4()), JOIN_FULL=joined[0], JOIN_COMP=joined[1],
        num_warps=warps,
        num_stages=stages, **pdl.launch_options(on), **register_cap(observe))
    out = merge_splits(out, part_o, part_lse, num_splits, on)
    if scored:
        P, block = mass.shape[-1], 512
        _observe_scores_kernel[(B, KVH, triton.cdiv(2 * P, block))](
            scores, part_lse, meta, meta.stride(0), mass, P, H=num_heads, KVH=KVH, G=G, G_PAD=g_pad,
            KV_BLOCK=block_size, NUM_SPLITS=num_splits,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), BLOCK=block, PDL=on, **pdl.launch_options(on))
    return out


def tiling_override() -> tuple[int, ...] | None:
    """O3EDGE_ROUTER_TILING=BLOCK_N,CTILE,WARPS,STAGES (a measurement switch): the router decode kernel's tiling
    in every step, as tools/bench_attention.py's config gives it one kernel at a time."""
    text = os.environ.get("O3EDGE_ROUTER_TILING")
    return tuple(int(x) for x in text.split(",")) if text else None


def observe_splits() -> bool:
    """Whether the router's observing graph steps keep their bucket's key splits (the scores stored, then
    observed by _observe_scores_kernel) instead of running in one (O3EDGE_ROUTER_OBSERVE_SPLITS=0). On by
    default: on the H200 (llama-1b, 16 sequences at 4,096 tokens, bf16) the observing attention took 59.7
    us a layer in 3 splits against 155.4 in one (uniform INT8), the observing step's replay ~2.1 ms against
    ~3.9, and whole decode with the INT8 router went from 7,113 to 7,380 tok/s (docs/benchmarks.md, ninth
    round; raw docs/results/gpu-2026-12-02/router-splits/)."""
    return os.environ.get("O3EDGE_ROUTER_OBSERVE_SPLITS", "1") != "0"


def router_decode_reference(qkv, cos, sin, meta, k_cache, v_cache, codes, scales, rotation, mode, num_heads,
                            block_size, mass=None):
    """Plain torch, one sequence at a time: what router_decode_attention computes (and writes); with
    mass [B, 2, P], the observed probabilities added to it (router_decode_attention's, summed over KV heads)."""
    from o3edge.engine.kv_quant import dequantize
    from o3edge.engine.rope import apply_rope

    B = qkv.shape[0]
    _, KVH, HD = k_cache.shape
    mb = (meta.shape[1] - 5) // 2
    qkv = qkv.view(B, num_heads + 2 * KVH, HD)
    outs = []
    for b in range(B):
        token, pos, slot, n_full, n_comp = meta[b, :5].tolist()
        q, k, v = qkv[b, :num_heads], qkv[b, num_heads:num_heads + KVH], qkv[b, num_heads + KVH:]
        q = apply_rope(q[None], cos[pos:pos + 1], sin[pos:pos + 1])[0]
        k = apply_rope(k[None], cos[pos:pos + 1], sin[pos:pos + 1])[0]
        k_cache[slot], v_cache[slot] = k, v
        keys = torch.arange(n_full, device=meta.device)
        slots = meta[b, 5 + keys // block_size].long() * block_size + keys % block_size
        slots = torch.cat((slots, torch.tensor([slot], device=meta.device)))
        kk, vv = k_cache[slots].float(), v_cache[slots].float()  # [S, KVH, hd]
        blocks = meta[b, 5 + mb:5 + mb + n_comp].long()
        cs = (blocks[:, None] * block_size + torch.arange(block_size, device=meta.device)).reshape(-1)
        kc = dequantize(codes[0, cs], scales[0, cs], mode, rotation)  # back in the model's basis
        vc = dequantize(codes[1, cs], scales[1, cs], mode, rotation)
        kk, vv = torch.cat((kk, kc)), torch.cat((vv, vc))
        kk = kk.repeat_interleave(num_heads // KVH, dim=1)
        vv = vv.repeat_interleave(num_heads // KVH, dim=1)
        att = torch.softmax(torch.einsum("hd,shd->hs", q.float(), kk) * HD ** -0.5, dim=-1)
        outs.append(torch.einsum("hs,shd->hd", att, vv).reshape(-1).to(k_cache.dtype))
        if mass is not None:
            mass[b, 0, :n_full + 1] += att[:, :n_full + 1].mean(0)
            mass[b, 1, :n_comp * block_size] += att[:, n_full + 1:].mean(0)
    return torch.stack(outs)
