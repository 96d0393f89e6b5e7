"""The tokens a top-p row, or a row of a top-k above TOP_K_CAP, keeps, found without sorting the row: a radix
select (sampling.NUCLEUS and WIDE_TOPK rows).

Top-k keeps the tokens at least the k-th largest (ties too); top-p then keeps, in descending order of logit
(ties: lower token id first), those whose mass before them is under top_p of what top-k kept. The kept set is
all the tokens above one cut value c, and the first few of those equal to c. The graph step's draw
(kernels/counter_draw.py) sorted the whole row to find it: on the H200 torch.sort took 51-134 µs a step at
batch 1-32 and the pass over the sorted row as much again (tools/bench_sampling.py), so top-p alone decoded
0.85-0.88x as fast as greedy. Here c is found by kernels, none of them a sort:
- each token's value v = x / T has a 32-bit key that orders as v does (order_key), and a weight exp(v - top)
  (top: the row's largest, at its greedy token) in fixed point, so that sums are exact in any order and the
  cut is the same whatever the programs' timing;
- _level_kernel, three times: the tokens' weights summed into bins of their key's top 11 bits (by atomic adds,
  a program per block of the row); then, within the bin where the mass from the top reaches top_p of the
  whole, the next 11 bits; then the last 10. Each level finds the previous level's bin again from its
  histogram (every program, a scan of 2,048 bins). For a WIDE_TOPK row the same three levels count tokens
  first (COUNT), the bin where the count from the top reaches k, so the k-th largest key is known exactly,
  and the weights of the tokens below it are left out of the mass levels;
- _resolve_kernel, a program a row: the last level's bin is one value, c; the mass above it says how many of
  the tokens equal to c are kept, and when not all, one pass finds the last kept one's id (L). Without top-p
  the cut is the k-th largest key itself.
The draw then keeps a token when its key is above c's, or equal with id <= L (cut_keeps). Rows of another
method return at once in every kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # tokens a program of a level kernel
WEIGHT_ONE = tl.constexpr(2.0 ** 40)  # exp(v - top) <= 1 in fixed point: up to 2**23 tokens sum within int64
BINS_HI, BINS_LO = tl.constexpr(2048), tl.constexpr(1024)  # bins of the first two levels (11 key bits), the last's
# a row's scratch, int64, two halves (the mass select's, then the count select's), each: the three levels'
# histograms, the last level's counts, then the state a level leaves the next: the row's total, the first
# level's bin and what is above it, the second's and its; and (mass half) the k-th largest key, the floor
_STATE = 2 * 2048 + 2 * 1024
TOTAL, BIN1, ABOVE1, BIN2, ABOVE2, FLOOR = (tl.constexpr(_STATE + i) for i in range(6))
HALF = tl.constexpr(_STATE + 8)
SCRATCH = tl.constexpr(2 * (_STATE + 8))


@triton.jit
def order_key(v):
    """int64 keys in [0, 2**32) of float32 values, ordered as the values are (-0.0 just below +0.0)."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 0x80000000


@triton.jit
def cut_keeps(key, token, cut_ptr, row):
    """Whether a row's filters keep tokens of these keys (order_key of x / T) and ids, by its cut (c's key, L)."""
    c = tl.load(cut_ptr + row * 2)
    return (key > c) | ((key == c) & (token <= tl.load(cut_ptr + row * 2 + 1)))


@triton.jit
def _crossing(h_ptr, above, thr, BINS: tl.constexpr):
    """The bin, of BINS from h_ptr, where the mass from the top (above, then the bins above it) first reaches
    thr, and the mass above it; (-1, 0) when it never does."""
    i = tl.arange(0, BINS)
    h = tl.load(h_ptr + BINS - 1 - i)  # the highest bin first
    seen = above + tl.cumsum(h, axis=0)
    first = tl.min(tl.where(seen.to(tl.float64) >= thr, i, BINS), axis=0)
    before = tl.sum(tl.where(i == first, seen - h, 0), axis=0)
    return tl.where(first < BINS, BINS - 1 - first, -1), tl.where(first < BINS, before, 0)


@triton.jit
def _row_values(x_ptr, greedy_ptr, cfg_ptr, row, offs, V, stride_x, stride_cfg, T_COL: tl.constexpr):
    """A block's keys and fixed-point weights (0 past V) of a row's values x / T."""
    t = tl.load(cfg_ptr + row * stride_cfg + T_COL)
    x_row = x_ptr + row * stride_x
    top = tl.load(x_row + tl.load(greedy_ptr + row)).to(tl.float32) / t
    v = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / t
    return order_key(v), (tl.exp(v - top) * WEIGHT_ONE).to(tl.int64)


@triton.jit
def _bin_key(bin1, bin2, bin3):
    """The key of the three levels' bins; -1 when any level found none."""
    return tl.where((bin1 >= 0) & (bin2 >= 0) & (bin3 >= 0), (bin1 * BINS_HI + bin2) * BINS_LO + bin3, -1)


@triton.jit
def _level_kernel(x_ptr, greedy_ptr, cfg_ptr, scratch_ptr, V, stride_x, stride_cfg, LEVEL: tl.constexpr,
                  COUNT: tl.constexpr, NUCLEUS_ID: tl.constexpr, WIDE_ID: tl.constexpr, T_COL: tl.constexpr,
                  K_COL: tl.constexpr, P_COL: tl.constexpr, M_COL: tl.constexpr, BLOCK: tl.constexpr):
    row, blk = tl.program_id(0), tl.program_id(1)
    cfg = cfg_ptr + row * stride_cfg
    method = tl.load(cfg + M_COL)
    if COUNT:
        mine_row = method == WIDE_ID
    else:
        mine_row = (method == WIDE_ID) | (method == NUCLEUS_ID)
    if mine_row:
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        key, weight = _row_values(x_ptr, greedy_ptr, cfg_ptr, row, offs, V, stride_x, stride_cfg, T_COL)
        s = scratch_ptr + row * SCRATCH
        if COUNT:  # the k-th largest: tokens counted, the k-th from the top
            h = s + HALF
            weight = tl.full([BLOCK], 1, tl.int64)
            floor = tl.zeros([], dtype=tl.int64)
        else:  # the mass from the top, over the tokens at least the k-th largest (none left out for top-p alone)
            h = s
            if LEVEL == 1:
                floor = tl.zeros([], dtype=tl.int64)
                if method == WIDE_ID:  # the count select's last level: the k-th largest key
                    c = s + HALF
                    k = tl.load(cfg + K_COL).to(tl.float64) + 1.0
                    bin3, _ = _crossing(c + 2 * BINS_HI, tl.load(c + ABOVE2), k, BINS_LO)
                    floor = tl.maximum(_bin_key(tl.load(c + BIN1), tl.load(c + BIN2), bin3), 0).to(tl.int64)
                if blk == 0:
                    tl.store(s + FLOOR, floor)
            else:
                floor = tl.load(s + FLOOR)
        mine = (offs < V) & (key >= floor)
        if LEVEL == 1:
            tl.atomic_add(h + (key >> 21), weight, mask=mine, sem="relaxed")
        else:
            if LEVEL == 2:
                total = tl.sum(tl.load(h + tl.arange(0, BINS_HI)), axis=0)
            else:
                total = tl.load(h + TOTAL)
            if COUNT:
                thr = tl.load(cfg + K_COL).to(tl.float64) + 1.0
            else:
                thr = tl.load(cfg + P_COL).to(tl.float64) * total.to(tl.float64)
            if LEVEL == 2:
                bin1, above = _crossing(h, 0, thr, BINS_HI)
                tl.atomic_add(h + BINS_HI + ((key >> 10) & (BINS_HI - 1)), weight, mask=mine & ((key >> 21) == bin1),
                              sem="relaxed")
                if blk == 0:
                    tl.store(h + TOTAL, total)
                    tl.store(h + BIN1, bin1)
                    tl.store(h + ABOVE1, above)
            else:
                bin1 = tl.load(h + BIN1)
                bin2, above = _crossing(h + BINS_HI, tl.load(h + ABOVE1), thr, BINS_HI)
                mine = mine & ((key >> 10) == (bin1 * BINS_HI + bin2)) & (bin1 >= 0) & (bin2 >= 0)
                low = h + 2 * BINS_HI + (key & (BINS_LO - 1))
                tl.atomic_add(low, weight, mask=mine, sem="relaxed")
                tl.atomic_add(low + BINS_LO, tl.full([BLOCK], 1, tl.int64), mask=mine, sem="relaxed")
                if blk == 0:
                    tl.store(h + BIN2, bin2)
                    tl.store(h + ABOVE2, above)


@triton.jit
def _resolve_kernel(x_ptr, greedy_ptr, cfg_ptr, scratch_ptr, cut_ptr, V: tl.constexpr, stride_x, stride_cfg,
                    NUCLEUS_ID: tl.constexpr, WIDE_ID: tl.constexpr, T_COL: tl.constexpr, P_COL: tl.constexpr,
                    M_COL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    method = tl.load(cfg_ptr + row * stride_cfg + M_COL)
    if (method == NUCLEUS_ID) | (method == WIDE_ID):
        s = scratch_ptr + row * SCRATCH
        total, floor = tl.load(s + TOTAL), tl.load(s + FLOOR)
        thr = tl.load(cfg_ptr + row * stride_cfg + P_COL).to(tl.float64) * total.to(tl.float64)
        bin3, above = _crossing(s + 2 * BINS_HI, tl.load(s + ABOVE2), thr, BINS_LO)
        c = _bin_key(tl.load(s + BIN1), tl.load(s + BIN2), bin3)  # c's key
        found = c >= 0
        c = tl.where(found, c, floor)  # no top-p (or its mass never reached): the k-th largest, or every token
        b3 = tl.maximum(bin3, 0)
        n = tl.maximum(tl.load(s + 2 * BINS_HI + BINS_LO + b3), 1)  # tokens equal to c, their weights the same
        each = (tl.load(s + 2 * BINS_HI + b3) // n).to(tl.float64)
        # the j-th of them (from 0) is kept while above + j * each < thr
        kept = tl.minimum(tl.maximum(tl.ceil((thr - above.to(tl.float64)) / tl.maximum(each, 1.0)), 1.0),
                          n.to(tl.float64)).to(tl.int64)
        last = V  # the id of the last kept token equal to c
        if found & (kept < n):
            seen = tl.zeros([], dtype=tl.int64)
            for k0 in range(0, V, BLOCK):
                offs = k0 + tl.arange(0, BLOCK)
                key, _ = _row_values(x_ptr, greedy_ptr, cfg_ptr, row, offs, V, stride_x, stride_cfg, T_COL)
                tie = ((key == c) & (offs < V)).to(tl.int64)
                at = seen + tl.cumsum(tie, axis=0)
                last = tl.minimum(last, tl.min(tl.where((tie > 0) & (at == kept), offs, V), axis=0))
                seen += tl.sum(tie, axis=0)
        tl.store(cut_ptr + row * 2, c)
        tl.store(cut_ptr + row * 2 + 1, last)


def nucleus_cut(logits: torch.Tensor, greedy: torch.Tensor, cfg: torch.Tensor, wide: bool, ids: dict,
                cols: dict) -> torch.Tensor:
    """The cut [B, 2] int64 (c's key, L: cut_keeps) of each NUCLEUS row and, with wide, each WIDE_TOPK row, for
    logits [B, V] (rows strided, columns not), greedy [B] the rows' argmax, cfg float32 [B, 5]
    (sampling.counter_settings); other rows' cut is left unwritten. ids: NUCLEUS_ID and WIDE_ID, the methods;
    cols: T_COL, K_COL, P_COL and M_COL, the settings' columns."""
    B, V = logits.shape
    scratch = torch.zeros(B, SCRATCH.value, dtype=torch.int64, device=logits.device)
    cut = torch.empty(B, 2, dtype=torch.int64, device=logits.device)
    grid = (B, triton.cdiv(V, BLOCK))
    for count in (True, False) if wide else (False,):
        for level in (1, 2, 3):
            _level_kernel[grid](logits, greedy, cfg, scratch, V, logits.stride(0), cfg.stride(0), LEVEL=level,
                                COUNT=count, BLOCK=BLOCK, num_warps=8, **ids, **cols)
    _resolve_kernel[(B,)](logits, greedy, cfg, scratch, cut, V, logits.stride(0), cfg.stride(0), BLOCK=BLOCK,
                          num_warps=8, **ids, **{k: v for k, v in cols.items() if k != "K_COL"})
    return cut
