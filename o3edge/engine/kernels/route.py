"""A graph refresh's routing in three kernels and one sort, instead of ~70 small operations.

A refresh step of the token router (engine/router.py) adds its observation to the saliency books and routes
again: router_graph.py's route graph ran KVRouter.observation_of, observe_books, held_observed and plan_mask,
~118 torch operations (~70 kernels) over a few [rows, 4,096] tensors, ~0.28 ms of device time a refresh on
an H100 at 16 x 3,840 (tools/profile_router_step.py --trace), each kernel a few microseconds of launch and
ramp for little work. Here, with the same inputs (entry_rows' rows on the device, the observing step's mass)
and the same result (plan_mask's rows):

- `_observe_kernel`, one program a row: each table entry's pool and place in it (a cumulative count), each of
  its keys' mass summed over the KV heads and added to the books at the key's position (one addition a
  position, as observe_books' index_add makes it), one observer more for every position before the row's
  context, then the row's saliency (mass / observers, 0 past the context) into a scratch row;
- torch.sort of the saliency rows (stable, descending: salient()'s order, ties by position);
- `_cover_kernel`, one program a row: the smallest prefix of the sorted row covering `threshold` of its total
  (a running sum in float64), the blocks holding one of those positions, and the demotions: the row's
  full-precision entries that are sealed, pinned neither as sinks nor in the recent window, and hold no
  salient position.

The sums run in another order than torch's (the KV heads' sum in float32, the running sum in tiles), so a
position exactly at the threshold may fall the other way; the books get the same additions. Static shapes, no
sync: a CUDA graph holds it. The default since it ran on an H100 (router_graph.fused_route;
O3EDGE_ROUTER_FUSED_ROUTE=0 runs the operations instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _observe_kernel(entries_ptr, stride_e, mass_ptr, stride_mr, stride_mk, stride_mp, bmass_ptr, bcount_ptr,
                    stride_b, sal_ptr, stride_s, NF, W: tl.constexpr, L: tl.constexpr, KVH: tl.constexpr,
                    BS: tl.constexpr, WB: tl.constexpr, LB: tl.constexpr):
    r = tl.program_id(0)
    row = entries_ptr + r * stride_e
    count = tl.load(row + W)
    book = tl.load(row + W + 1)
    end = tl.load(row + W + 2)
    i = tl.arange(0, WB)
    t = tl.load(row + i, mask=i < W, other=0)
    valid = i < count
    comp = valid & (t >= NF)
    full = valid & (t < NF)
    rank = tl.where(comp, tl.cumsum(comp.to(tl.int32), 0), tl.cumsum(full.to(tl.int32), 0)) - 1
    comp_keys = tl.sum(comp.to(tl.int32), 0) * BS
    num_keys = tl.where(comp, comp_keys, end - comp_keys)  # the full pool's keys: the new token's too
    k = tl.arange(0, BS)
    q = rank[:, None] * BS + k[None, :]  # each key's place in its pool (the observing step's mass column)
    ok = valid[:, None] & (q < num_keys[:, None])
    src = mass_ptr + r * stride_mr + comp.to(tl.int64)[:, None] * stride_mp + q
    add = tl.zeros([WB, BS], tl.float32)
    for h in tl.static_range(KVH):  # the KV heads' sum in float32, as mass.sum(1) makes it
        add += tl.load(src + h * stride_mk, mask=ok, other=0.0)
    books = bmass_ptr + book * stride_b
    pos = i[:, None] * BS + k[None, :]  # each key's position in the sequence
    tl.store(books + pos, tl.load(books + pos, mask=ok, other=0.0) + add.to(tl.float64), mask=ok)
    counts = bcount_ptr + book * stride_b
    for l0 in range(0, L, LB):  # one observer more up to its own position
        lane = l0 + tl.arange(0, LB)
        seen = lane < end
        tl.store(counts + lane, tl.load(counts + lane, mask=seen, other=0.0) + 1.0, mask=seen)
    tl.debug_barrier()  # this program's additions, visible to all its threads
    for l0 in range(0, L, LB):  # saliency_of: mass / observers, 0 past the context
        lane = l0 + tl.arange(0, LB)
        seen = lane < end
        m = tl.load(books + lane, mask=seen, other=0.0)
        c = tl.load(counts + lane, mask=seen, other=1.0)
        tl.store(sal_ptr + r * stride_s + lane, tl.where(seen, m / tl.maximum(c, 1.0), 0.0), mask=lane < L)


@triton.jit
def _scan_tile(vals_ptr, l0, L: tl.constexpr, carry, LB: tl.constexpr):
    """The running sum of sorted values [l0, l0 + LB) after carry, and its last element."""
    lane = l0 + tl.arange(0, LB)
    covered = tl.cumsum(tl.load(vals_ptr + lane, mask=lane < L, other=0.0), 0) + carry
    return lane, covered, tl.sum(tl.where(tl.arange(0, LB) == LB - 1, covered, 0.0), 0)


@triton.jit
def _cover_kernel(vals_ptr, order_ptr, stride_v, entries_ptr, stride_e, held_ptr, stride_h, out_ptr, stride_o, NF,
                  THRESHOLD, FIRST, RECENT, W: tl.constexpr, L: tl.constexpr, BS: tl.constexpr, WB: tl.constexpr,
                  LB: tl.constexpr):
    r = tl.program_id(0)
    vals = vals_ptr + r * stride_v
    total = tl.zeros([], tl.float64)  # the scan's own last element (not a sum in another order): the second
    for l0 in range(0, L, LB):       # pass's running sums reach it exactly, as torch's cumsum reaches its total
        _, _, total = _scan_tile(vals, l0, L, total, LB)
    carry = tl.zeros([], tl.float64)
    below = tl.zeros([], tl.int32)  # positions whose running sum stays below threshold x total
    for l0 in range(0, L, LB):
        lane, covered, carry = _scan_tile(vals, l0, L, carry, LB)
        below += tl.sum(((covered < THRESHOLD * total) & (lane < L)).to(tl.int32), 0)
    picked = tl.where((total > 0) & (THRESHOLD > 0), below + 1, 0)  # the first prefix reaching the threshold
    i = tl.arange(0, WB)
    held = held_ptr + r * stride_h
    tl.store(held + i, tl.zeros([WB], tl.int32), mask=i < W)
    tl.debug_barrier()
    sealed = (L // BS) * BS  # positions of whole blocks (sealed_any)
    for l0 in range(0, L, LB):
        rank = l0 + tl.arange(0, LB)
        pick = rank < picked
        at = tl.load(order_ptr + r * stride_v + rank, mask=pick, other=0)
        pick &= at < sealed
        tl.store(held + at // BS, tl.full([LB], 1, tl.int32), mask=pick & (at // BS < W))
    tl.debug_barrier()
    row = entries_ptr + r * stride_e
    t = tl.load(row + i, mask=i < W, other=0)
    count = tl.load(row + W)
    end = tl.load(row + W + 2)
    stop = tl.minimum((end - RECENT) // BS, end // BS)  # (a negative stop and col >= 0: nothing, as floored)
    ok = (i < count) & (t < NF) & (i >= FIRST) & (i < stop)
    ok &= tl.load(held + i, mask=i < W, other=1) == 0
    tl.store(out_ptr + r * stride_o + i, ok, mask=i < W)


def route(entries: torch.Tensor, mass: torch.Tensor, books_mass: torch.Tensor, books_count: torch.Tensor,
          num_full_blocks: int, block_size: int, threshold: float, first: int, recent_tokens: int) -> torch.Tensor:
    """KVRouter's observation_of, observe_books, held_observed and plan_mask in three kernels and a sort:
    entries int64 [n, W + 3] (entry_rows' rows), mass float32 [n, KVH, 2, P] (the observing step's, P = W *
    block_size), the books' float64 [rows, L] tables (added to in place); first: the first unpinned table
    index (unpinned_bounds). Returns plan_mask's bool [n, W]."""
    n, W, L = entries.shape[0], entries.shape[1] - 3, books_mass.shape[1]
    mass = mass.contiguous()
    sal = torch.empty(n, L, dtype=torch.float64, device=entries.device)
    wb, lb = triton.next_power_of_2(max(W, 2)), min(1024, triton.next_power_of_2(L))
    _observe_kernel[(n,)](entries, entries.stride(0), mass, mass.stride(0), mass.stride(1), mass.stride(2),
                          books_mass, books_count, books_mass.stride(0), sal, sal.stride(0), num_full_blocks, W=W, L=L,
                          KVH=mass.shape[1], BS=block_size, WB=wb, LB=lb, num_warps=8)
    vals, order = torch.sort(sal, dim=1, descending=True, stable=True)
    held = torch.empty(n, W, dtype=torch.int32, device=entries.device)
    out = torch.empty(n, W, dtype=torch.bool, device=entries.device)
    _cover_kernel[(n,)](vals, order, vals.stride(0), entries, entries.stride(0), held, held.stride(0), out,
                        out.stride(0), num_full_blocks, threshold, first, recent_tokens, W=W, L=L, BS=block_size,
                        WB=wb, LB=lb, num_warps=8)
    return out
