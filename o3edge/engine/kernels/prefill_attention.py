"""Causal attention for prompt chunks over the paged KV cache, several sequences of any lengths at once.

A step that prefills (a fresh prompt, the suffix after a prefix-cache or cold-tier hit, a chunk of a
long prompt), possibly beside decodes, gives sequence b `q_len` new tokens at positions `start` ..
`start + q_len - 1`; their keys and values are already in the cache. One program takes a tile of one
sequence's queries for one head and runs an online softmax over that sequence's keys, read in place
through its block table, up to each query's own position: no gather of the context into a padded
copy, no [B, Q, S] mask, no work for padding. Flat queries are [T, H, hd] as the eager model packs
them; `seqs` is int32 [B, 3] = (first flat row, q_len, start) and `tables` int32 [B, max_blocks].

A short chunk over a long prefix (the suffix of a prefix-cache or cold-tier hit: 16 new tokens after
4,096 cached ones) has few tiles: one per head, 32 programs on a GPU of 132 SMs, each walking the
whole prefix alone. Then the keys are split into up to MAX_SPLITS ranges on programs of their own
(as decode attention does), each writing a partial output and log-sum-exp that a second small kernel
merges. The number of splits depends on the shapes only (batch, heads, tiles), never on the prefix
length, so a CUDA graph captured for a token bucket serves every prefix; a split that finds no keys
for a row (a short prefix) gets weight 0 in the merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from o3edge.engine.kernels import INTERPRET, num_sms
from o3edge.engine.kernels.decode_attention import merge_splits, paged_scores, softmax_step, split_range

MAX_SPLITS = 16  # key splits of one tile at most (the merge reads them all: keep it small)



@triton.jit
def _tile(q, m, l_sum, acc, n0, q_pos, kv_end, table, k_cache_ptr, v_cache_ptr, stride_slot, kvh, sm_scale, d,
          HD: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, dtype,
          SPLIT: tl.constexpr):
    offs, n_mask, s, v = paged_scores(q, n0, kv_end, table, k_cache_ptr, v_cache_ptr, stride_slot, kvh, d, HD,
                                      KV_BLOCK, BLOCK_N, IEEE)
    ok = n_mask[None, :] & (offs[None, :] <= q_pos[:, None])  # causal: up to the query's own position
    s = tl.where(ok, s * sm_scale, float("-inf"))  # key 0 is in every row's first tile (one split)
    # with key splits, a split may start past a row's position: a row may see no key in a tile, or in any
    return softmax_step(s, v, m, l_sum, acc, IEEE, dtype, SPLIT)


@triton.jit
def _prefill_attention_kernel(q_ptr, stride_qt, stride_qh, seqs_ptr, tables_ptr, stride_table, k_cache_ptr,
                              v_cache_ptr, stride_slot, out_ptr, stride_ot, stride_oh, part_o_ptr, part_lse_ptr,
                              sm_scale, H: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, HD_PAD: tl.constexpr,
                              KV_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    b, h, pid = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pid_m, split = pid // NUM_SPLITS, pid % NUM_SPLITS
    first = tl.load(seqs_ptr + b * 3)
    q_len = tl.load(seqs_ptr + b * 3 + 1)
    start = tl.load(seqs_ptr + b * 3 + 2)
    i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if pid_m * BLOCK_M < q_len:  # tiles past this sequence's chunk have nothing to do
        dtype = k_cache_ptr.dtype.element_ty
        kvh = h // G
        d = tl.arange(0, HD_PAD)
        row_mask = i < q_len
        q_mask = row_mask[:, None] & (d < HD)[None, :]
        rows = (first + i).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=q_mask, other=0.0)
        q_pos = start + i
        kv_end = start + tl.minimum(q_len, (pid_m + 1) * BLOCK_M)  # keys the tile's last query sees
        lo, hi = split_range(kv_end, split, NUM_SPLITS, BLOCK_N)  # this program's keys (all of them: 1 split)
        table = tables_ptr + b * stride_table
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD_PAD], tl.float32)
        if INTERPRET:  # the interpreter cannot take a tensor as a range bound
            n0 = lo
            while n0 < hi:
                m, l_sum, acc = _tile(q, m, l_sum, acc, n0, q_pos, hi, table, k_cache_ptr, v_cache_ptr,
                                      stride_slot, kvh, sm_scale, d, HD, KV_BLOCK, BLOCK_N, IEEE, dtype,
                                      NUM_SPLITS > 1)
                n0 += BLOCK_N
        else:
            for n0 in range(lo, hi, BLOCK_N):
                m, l_sum, acc = _tile(q, m, l_sum, acc, n0, q_pos, hi, table, k_cache_ptr, v_cache_ptr,
                                      stride_slot, kvh, sm_scale, d, HD, KV_BLOCK, BLOCK_N, IEEE, dtype,
                                      NUM_SPLITS > 1)
        if NUM_SPLITS == 1:
            o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
            tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :], o.to(dtype), mask=q_mask)
        else:  # this split's normalized partial output and log-sum-exp (no key: 0 and -inf)
            has = l_sum > 0
            o = tl.where(has[:, None], acc / tl.where(has, l_sum, 1.0)[:, None], 0.0)
            lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
            part = (rows * H + h) * NUM_SPLITS + split
            tl.store(part_o_ptr + part[:, None] * HD + d[None, :], o, mask=q_mask)
            tl.store(part_lse_ptr + part, lse, mask=row_mask)


def num_key_splits(num_programs: int, device) -> int:
    """Key splits that bring a launch of num_programs tiles up to about twice the SMs (1 when it fills them)."""
    sms = num_sms(str(device))
    if num_programs >= sms:
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(-(-2 * sms // num_programs)))


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: torch.Tensor,
                      tables: torch.Tensor, max_q: int, block_size: int, num_splits: int | None = None) -> torch.Tensor:
    """q: [T, H, hd] (any strides with hd contiguous); caches [slots, KVH, hd] holding every new key;
    seqs int32 [B, 3] (first row, q_len, start); tables int32 [B, blocks]. Returns [T, H, hd].
    num_splits: key splits per tile (a power of two); by default enough to fill the GPU (shapes only)."""
    T, H, HD = q.shape
    KVH = k_cache.shape[1]
    out = torch.zeros(T, H, HD, device=q.device, dtype=q.dtype)  # rows past a chunk (graph padding) stay 0
    block_m = 16 if max_q <= 16 else 64
    hd_pad = max(16, triton.next_power_of_2(HD))
    tiles = triton.cdiv(max_q, block_m)
    splits = num_splits or num_key_splits(seqs.shape[0] * H * tiles, q.device)
    part_o = part_lse = out
    if splits > 1:  # lse -inf everywhere first: rows no program writes (padding) merge to 0
        part_o = torch.empty(T, H, splits, HD, device=q.device, dtype=torch.float32)
        part_lse = torch.full((T, H, splits), float("-inf"), device=q.device, dtype=torch.float32)
    _prefill_attention_kernel[(seqs.shape[0], H, tiles * splits)](
        q, q.stride(0), q.stride(1), seqs, tables, tables.stride(0), k_cache, v_cache, k_cache.stride(0),
        out, out.stride(0), out.stride(1), part_o, part_lse, HD ** -0.5, H=H, G=H // KVH, HD=HD, HD_PAD=hd_pad,
        KV_BLOCK=block_size, BLOCK_M=block_m, BLOCK_N=64 if HD <= 64 else 32, NUM_SPLITS=splits,
        IEEE=q.dtype == torch.float32, INTERPRET=INTERPRET, num_warps=4, num_stages=2)
    merge_splits(out.view(T, H * HD), part_o, part_lse, splits, pdl_on=False)  # out: contiguous, fresh
    return out


def prefill_attention_reference(q, k_cache, v_cache, seqs, tables, block_size):
    """Plain torch, one sequence at a time: causal attention of each chunk over its cached prefix + itself."""
    T, H, HD = q.shape
    G = H // k_cache.shape[1]
    out = torch.zeros_like(q)
    for b, (first, n, start) in enumerate(seqs.tolist()):
        keys = torch.arange(start + n, device=q.device)
        slots = tables[b, keys // block_size].long() * block_size + keys % block_size
        kk = k_cache[slots].float().repeat_interleave(G, dim=1)  # [S, H, hd]
        vv = v_cache[slots].float().repeat_interleave(G, dim=1)
        qq = q[first:first + n].float()  # [n, H, hd]
        s = torch.einsum("nhd,shd->hns", qq, kk) * HD ** -0.5
        causal = keys[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
        att = torch.softmax(s.masked_fill(~causal[None], float("-inf")), dim=-1)
        out[first:first + n] = torch.einsum("hns,shd->nhd", att, vv).to(q.dtype)
    return out
