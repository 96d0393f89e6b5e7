"""The graph step's draw of sampled tokens (sampling.counter_sample) in a few kernels.

A sampled token is argmax(x / T + G) over the tokens a request's filters keep (x its logits, G the counter
Gumbel noise of kernels/noise.py). A row is drawn one of three ways, by its own settings (sampling.py, METHOD):
- RACE, no filter: one pass over the vocabulary, each block's best, then the best of those (_race_kernel);
- NUCLEUS, top-p alone, and WIDE_TOPK, a top-k above TOP_K_CAP (with or without top-p): the same pass over the
  tokens its cut keeps, the cut found by selection, not by a sort (kernels/nucleus.py); drawn over the sorted row
  before, top-p alone decoded 0.85-0.88x as fast as greedy;
- TOPK, a top-k within TOP_K_CAP: over each block's largest by Triton's bitonic top-k (_block_top_kernel),
  then the largest of those (_topk_draw_kernel); with O3EDGE_TRITON_TOPK=0, over torch.topk's largest logits
  (_filtered_kernel), as before: on the H200 torch.topk took ~48-63 µs a step at batch 1-32
  (tools/bench_sampling.py), more than the rest of the draw, and Triton's made whole sampled generations
  1-6% faster (T 1.0 at batch 1: 1,213 -> 1,286 tok/s, greedy 1,309; docs/results/gpu-2026-12-03h/);
_filtered_kernel and _topk_draw_kernel take candidates in descending order and filter them by one rule
(_block_draw): top-k keeps those at least the k-th (ties too), top-p the first whose mass before them is
under top_p (over the probabilities renormalised after top-k), and the draw is the best score among them.
_pick_kernel then writes each row's token: greedy rows keep their argmax.
Written as torch operations (~30 kernels) a T 1.0 draw added 102 µs to a batch-1 step on the H200; in these
kernels with torch.topk 61 (tools/bench_gpu.py --sampled, tinyllama-1.1b fp16), with Triton's top-k 14.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from o3edge.engine.kernels.noise import _gumbel
from o3edge.engine.kernels.nucleus import cut_keeps, nucleus_cut, order_key
from o3edge.engine.sampling import (GREEDY, KTH, METHOD, NUCLEUS, RACE, TEMPERATURE, TOP_K_CAP, TOP_P, TOPK,
                                    WIDE_TOPK)

RACE_BLOCK = 1024
TOP_BLOCK = 2048  # a block of logits whose TOP_K_CAP largest are a TOPK row's candidates


@triton.jit
def _race_kernel(x_ptr, cfg_ptr, seed_ptr, counter_ptr, cut_ptr, val_ptr, idx_ptr, V, stride_x, stride_cfg,
                 stride_seed, stride_counter, BLOCKS, T_COL: tl.constexpr, M_COL: tl.constexpr, CUT: tl.constexpr,
                 NUCLEUS_ID: tl.constexpr, WIDE_ID: tl.constexpr, BLOCK: tl.constexpr):
    row, blk = tl.program_id(0), tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    t = tl.load(cfg_ptr + row * stride_cfg + T_COL)
    v = x / t
    if CUT:  # a NUCLEUS or WIDE_TOPK row keeps what its cut keeps (kernels/nucleus.py)
        method = tl.load(cfg_ptr + row * stride_cfg + M_COL)
        if (method == NUCLEUS_ID) | (method == WIDE_ID):
            mask = mask & cut_keeps(order_key(v), offs, cut_ptr, row)
    score = tl.where(mask, v + _gumbel(seed_ptr, counter_ptr, row, stride_seed, stride_counter, offs),
                     float("-inf"))
    tl.store(val_ptr + row * BLOCKS + blk, tl.max(score, axis=0))
    tl.store(idx_ptr + row * BLOCKS + blk, blk * BLOCK + tl.argmax(score, axis=0))


@triton.jit
def _block_draw(v, ids, kth, top, total, before, top_p, seed_ptr, counter_ptr, row, stride_seed, stride_counter,
                BLOCK: tl.constexpr):
    """One block of a row's candidates in descending order (scaled logits v, -inf where none; token ids):
    top-k keeps those at least kth, top-p those whose mass before them (before: the earlier blocks') is under
    top_p, over the probabilities exp(v - top) / total. (best score, its token, this block's mass)."""
    p = tl.where(v >= kth, tl.exp(v - top) / total, 0.0)
    keep = (before + tl.cumsum(p, axis=0) - p < top_p) & (v >= kth)
    score = tl.where(keep, v + _gumbel(seed_ptr, counter_ptr, row, stride_seed, stride_counter, ids), float("-inf"))
    token = tl.sum(tl.where(tl.arange(0, BLOCK) == tl.argmax(score, axis=0), ids, 0), axis=0)
    return tl.max(score, axis=0), token, tl.sum(p, axis=0)


@triton.jit
def _filtered_kernel(v_ptr, ids_ptr, cfg_ptr, seed_ptr, counter_ptr, out_ptr, K: tl.constexpr, stride_v,
                     stride_ids, stride_cfg, stride_seed, stride_counter, MINE: tl.constexpr, T_COL: tl.constexpr,
                     K_COL: tl.constexpr, P_COL: tl.constexpr, M_COL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cfg = cfg_ptr + row * stride_cfg
    if tl.load(cfg + M_COL) == MINE:
        t, top_p = tl.load(cfg + T_COL), tl.load(cfg + P_COL)
        v_row, ids_row = v_ptr + row * stride_v, ids_ptr + row * stride_ids
        top = tl.load(v_row).to(tl.float32) / t
        kth = tl.load(v_row + tl.minimum(tl.load(cfg + K_COL).to(tl.int32), K - 1)).to(tl.float32) / t
        total = 0.0  # the softmax's normaliser over what top-k keeps
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            v = tl.load(v_row + offs, mask=offs < K, other=float("-inf")).to(tl.float32) / t
            total += tl.sum(tl.where(v >= kth, tl.exp(v - top), 0.0), axis=0)
        before, best, best_id = 0.0, float("-inf"), 0  # mass before this block; the best score so far, its token
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            mask = offs < K
            v = tl.load(v_row + offs, mask=mask, other=float("-inf")).to(tl.float32) / t
            ids = tl.load(ids_row + offs, mask=mask, other=0).to(tl.int32)
            m, token, mass = _block_draw(v, ids, kth, top, total, before, top_p, seed_ptr, counter_ptr, row,
                                         stride_seed, stride_counter, BLOCK)
            best_id = tl.where(m > best, token, best_id)
            best = tl.maximum(best, m)
            before += mass
        tl.store(out_ptr + row, best_id.to(tl.int64))


@triton.jit
def _key(x, token):
    """int64 keys that order (logit, token) pairs by logit, then lower token first: the float's bits made
    to order as signed integers, above 0x7FFFFFFF - token."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - token).to(tl.int64)


@triton.jit
def _unkey(key):
    """(logit, token) of _key's keys."""
    ordered = (key >> 32).to(tl.int32)
    x = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)
    return x, 0x7FFFFFFF - (key & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def _block_top_kernel(x_ptr, cfg_ptr, top_ptr, V, stride_x, stride_cfg, BLOCKS, MINE: tl.constexpr,
                      M_COL: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """The CAP largest logits of one block of a TOPK row, as keys in descending order."""
    row, blk = tl.program_id(0), tl.program_id(1)
    if tl.load(cfg_ptr + row * stride_cfg + M_COL) == MINE:
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        tl.store(top_ptr + (row * BLOCKS + blk) * CAP + tl.arange(0, CAP), tl.topk(_key(x, offs), CAP))


@triton.jit
def _topk_draw_kernel(top_ptr, cfg_ptr, seed_ptr, counter_ptr, out_ptr, BLOCKS, stride_cfg, stride_seed,
                      stride_counter, K: tl.constexpr, MINE: tl.constexpr, T_COL: tl.constexpr, K_COL: tl.constexpr,
                      P_COL: tl.constexpr, M_COL: tl.constexpr, CAP: tl.constexpr, CANDIDATES: tl.constexpr):
    """A TOPK row's draw over the CAP largest of its blocks' candidates (K = min(CAP, V) of them real),
    filtered by _block_draw as _filtered_kernel's blocks are."""
    row = tl.program_id(0)
    cfg = cfg_ptr + row * stride_cfg
    if tl.load(cfg + M_COL) == MINE:
        offs = tl.arange(0, CANDIDATES)
        keys = tl.load(top_ptr + row * BLOCKS * CAP + offs, mask=offs < BLOCKS * CAP, other=-0x7FFFFFFFFFFFFFFF)
        x, ids = _unkey(tl.topk(keys, CAP))
        pos = tl.arange(0, CAP)
        t, top_p = tl.load(cfg + T_COL), tl.load(cfg + P_COL)
        v = tl.where(pos < K, x / t, float("-inf"))
        kth = tl.sum(tl.where(pos == tl.minimum(tl.load(cfg + K_COL).to(tl.int32), K - 1), v, 0.0), axis=0)
        top = tl.max(v, axis=0)
        total = tl.sum(tl.where(v >= kth, tl.exp(v - top), 0.0), axis=0)
        _, token, _ = _block_draw(v, ids, kth, top, total, 0.0, top_p, seed_ptr, counter_ptr, row, stride_seed,
                                  stride_counter, CAP)
        tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _pick_kernel(cfg_ptr, greedy_ptr, val_ptr, idx_ptr, drawn_ptr, out_ptr, stride_cfg, BLOCKS,
                 G_COL: tl.constexpr, M_COL: tl.constexpr, RACE_ID: tl.constexpr, NUCLEUS_ID: tl.constexpr,
                 WIDE_ID: tl.constexpr, BLOCKS_P2: tl.constexpr):
    row = tl.program_id(0)
    cfg = cfg_ptr + row * stride_cfg
    offs = tl.arange(0, BLOCKS_P2)
    val = tl.load(val_ptr + row * BLOCKS + offs, mask=offs < BLOCKS, other=float("-inf"))
    raced = tl.load(idx_ptr + row * BLOCKS + tl.argmax(val, axis=0)).to(tl.int64)
    method = tl.load(cfg + M_COL)
    token = tl.where((method == RACE_ID) | (method == NUCLEUS_ID) | (method == WIDE_ID), raced,
                     tl.load(drawn_ptr + row))
    token = tl.where(tl.load(cfg + G_COL) > 0, tl.load(greedy_ptr + row).to(tl.int64), token)
    tl.store(out_ptr + row, token)


def draw(logits: torch.Tensor, greedy: torch.Tensor, cfg: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
         topk: bool = True, nucleus: bool = True, wide: bool = True) -> torch.Tensor:
    """sampling.counter_sample's tokens [B] (int64): logits [B, V] (rows strided, columns not), greedy [B] the
    rows' argmax, cfg float32 [B, 5] (sampling.counter_settings, contiguous rows), seeds and counters [B]
    (strided views will do); topk=False, nucleus=False and wide=False leave TOPK, NUCLEUS and WIDE_TOPK rows
    undrawn (no such row in the batch; WIDE_TOPK rows need nucleus too)."""
    B, V = logits.shape
    dev = logits.device
    blocks = triton.cdiv(V, RACE_BLOCK)
    val = torch.empty(B, blocks, dtype=torch.float32, device=dev)
    idx = torch.empty(B, blocks, dtype=torch.int32, device=dev)
    strides = (cfg.stride(0), seeds.stride(0), counters.stride(0))
    cols = dict(T_COL=TEMPERATURE, K_COL=KTH, P_COL=TOP_P, M_COL=METHOD)
    methods = dict(NUCLEUS_ID=NUCLEUS, WIDE_ID=WIDE_TOPK)
    cut = nucleus_cut(logits, greedy, cfg, wide, methods, cols) if nucleus else None
    _race_kernel[(B, blocks)](logits, cfg, seeds, counters, cut, val, idx, V, logits.stride(0), *strides, blocks,
                              T_COL=TEMPERATURE, M_COL=METHOD, CUT=nucleus, BLOCK=RACE_BLOCK, num_warps=4, **methods)
    drawn = torch.empty(B, dtype=torch.long, device=dev)
    if topk and os.environ.get("O3EDGE_TRITON_TOPK") != "0":  # each block's TOP_K_CAP largest, then the draw
        block = max(TOP_K_CAP, min(TOP_BLOCK, triton.next_power_of_2(V)))  # over the largest of those
        top_blocks = triton.cdiv(V, block)
        top = torch.empty(B, top_blocks * TOP_K_CAP, dtype=torch.int64, device=dev)
        _block_top_kernel[(B, top_blocks)](logits, cfg, top, V, logits.stride(0), cfg.stride(0), top_blocks,
                                           MINE=TOPK, M_COL=METHOD, CAP=TOP_K_CAP, BLOCK=block, num_warps=4)
        _topk_draw_kernel[(B,)](top, cfg, seeds, counters, drawn, top_blocks, *strides, K=min(TOP_K_CAP, V),
                                MINE=TOPK, CAP=TOP_K_CAP, CANDIDATES=triton.next_power_of_2(top_blocks * TOP_K_CAP),
                                num_warps=4, **cols)
    elif topk:
        top, ids = torch.topk(logits, min(TOP_K_CAP, V), dim=-1)
        _filtered_kernel[(B,)](top, ids, cfg, seeds, counters, drawn, top.shape[1], top.stride(0), ids.stride(0),
                               *strides, MINE=TOPK, BLOCK=triton.next_power_of_2(top.shape[1]), num_warps=2, **cols)
    out = torch.empty(B, dtype=torch.long, device=dev)
    _pick_kernel[(B,)](cfg, greedy, val, idx, drawn, out, cfg.stride(0), blocks, G_COL=GREEDY, M_COL=METHOD,
                       RACE_ID=RACE, BLOCKS_P2=triton.next_power_of_2(blocks), num_warps=1, **methods)
    return out
