"""Split work finished by its last arrival: no second kernel to combine partial results.

A skinny matmul split along K leaves each program with a partial result of one output tile. Instead of
a second kernel launch that sums them, every program stores its partial, then counts itself in on the
tile's counter; the one that arrives last (it sees every other partial: they were written before their
counts) sums them, in a fixed order so the result does not depend on which program that was, and
resets the counter. On the H200 this took the split-K sum kernels (1 us each) out of a decode step.

Decode attention's key splits keep their merge kernel (1.8 us a layer). Tried on the H200 (tinyllama,
batch 1, one device call each, so not the same machine): the last split merging its GQA group's heads
one after another cost 11.5 us a layer; one split for contexts up to 256 keys (no merge at all)
7.8 us, its key tiles in series; the split kernel plus merge 5.4 us (docs/results/gpu-2026-11-30b/).
Tried again on 2026-12-04 at one row, the group's heads merged at once by the last split and splits past
the context returning at once (docs/results/gpu-2026-12-04-fifteenth/): alone, 3.61 us a layer against
3.81 at 200 keys with one 256-key tile on 8 warps, but 6.23 against 3.89 at 1,000 keys; in the step (graph
replay, tinyllama-1.1b at ~130 keys) fp16 0.758 -> 0.821 ms and every linear INT4 0.471 -> 0.481; with
today's 64-key tiles 0.759 -> 0.757 and 0.470 -> 0.473. The merge kernel, launched early by PDL, costs the
step nothing measurable; the code was not kept.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

COUNTERS = 1 << 16


@functools.lru_cache(maxsize=None)
def _counters(device: str) -> torch.Tensor:
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """n int32 counters at zero, for kernels whose last-arriving program finishes a tile the others
    started. Every such kernel leaves them at zero again, and
    kernels of one stream run one after the other, so one buffer per device serves them all; it is made
    at the first (uncaptured, warm-up) call, never inside a CUDA graph."""
    if n > COUNTERS:
        raise ValueError(f"{n} arrival counters asked, {COUNTERS} exist")
    return _counters(str(device))[:n]


@triton.jit
def last_arrival(part_ptrs, part, mask, count_ptr, programs):
    """Store this program's partial result, then count it in: whether it was the last of the `programs`
    sharing count_ptr, which then reads every partial (written before their counts, so visible to it;
    read past L1: cache_modifier=".cg") and resets the counter for the next launch."""
    tl.store(part_ptrs, part, mask=mask)
    tl.debug_barrier()  # all of this program's stores are issued before its count
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    last = arrived == programs - 1
    if last:
        tl.atomic_xchg(count_ptr, 0)
    return last
