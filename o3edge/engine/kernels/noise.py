"""Counter-based exponential noise for sampling inside a CUDA graph.

A sampled token is argmax(p / E) over the vocabulary with E ~ Exp(1) (the "exponential race", a draw from
p: sampling.py). Drawn from a request's own torch.Generator the noise cannot live in a captured graph (a
generator's state is the host's), so a graph step draws it from a counter instead: row r's E[v] is a
function of (its request's seed, its counter, v) alone, by Philox (tl.rand) keyed by the seed and the
counter. Whatever else is in the batch, and whichever step or row takes it, a request gets the same noise
for the same token (sampling.counter_sample).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _noise_kernel(seed_ptr, counter_ptr, out_ptr, V, stride_seed, stride_counter, stride_out, BLOCK: tl.constexpr):
    row, blk = tl.program_id(0), tl.program_id(1)
    seed = tl.load(seed_ptr + row * stride_seed).to(tl.int64)
    counter = tl.load(counter_ptr + row * stride_counter).to(tl.int64)
    key = seed * 6364136223846793005 + counter * 1442695040888963407 + 1  # one Philox key per (seed, counter)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    u = tl.rand(key, offs)  # uniform in [0, 1)
    tl.store(out_ptr + row * stride_out + offs, -tl.log(1.0 - u), mask=offs < V)


def exponential_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 Exp(1) noise, row r a function of (seeds[r], counters[r]) alone (int64 seeds, int
    counters, on the device; either may be a strided view, e.g. a column of the step's metadata)."""
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    _noise_kernel[(seeds.shape[0], triton.cdiv(vocab, BLOCK))](seeds, counters, out, vocab, seeds.stride(0),
                                                               counters.stride(0), out.stride(0), BLOCK=BLOCK,
                                                               num_warps=4)
    return out
