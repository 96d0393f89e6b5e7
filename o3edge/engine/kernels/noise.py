"""Counter-based noise for sampling inside a CUDA graph.

A sampled token is argmax(p / E) over the tokens a request's filters keep, with E ~ Exp(1) (the "exponential
race", a draw from p: sampling.py); in logits, argmax(x / T + G) with G = -log E (the Gumbel-max form, which
needs no softmax). Drawn from a request's own torch.Generator the noise cannot live in a captured graph (a
generator's state is the host's), so a graph step draws it from a counter instead: row r's G[v] is a function
of (its request's seed, its counter, v) alone, by Philox (tl.rand) keyed by the seed and the counter. Whatever
else is in the batch, and whichever step or row takes it, a request gets the same noise for the same token
(sampling.counter_sample).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _gumbel(seed_ptr, counter_ptr, row, stride_seed, stride_counter, token):
    """G = -log(E) of the given token ids (int32) of a row, E = -log(1 - U), U from Philox keyed by
    (seed, counter)."""
    seed = tl.load(seed_ptr + row * stride_seed).to(tl.int64)
    counter = tl.load(counter_ptr + row * stride_counter).to(tl.int64)
    key = seed * 6364136223846793005 + counter * 1442695040888963407 + 1  # one Philox key per (seed, counter)
    u = tl.rand(key, token)  # uniform in [0, 1)
    return -tl.log(-tl.log(1.0 - u))


@triton.jit
def _noise_kernel(seed_ptr, counter_ptr, ids_ptr, out_ptr, N, stride_seed, stride_counter, stride_ids, stride_out,
                  IDS: tl.constexpr, BLOCK: tl.constexpr):
    row, blk = tl.program_id(0), tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    token = offs
    if IDS:
        token = tl.load(ids_ptr + row * stride_ids + offs, mask=mask, other=0).to(tl.int32)
    g = _gumbel(seed_ptr, counter_ptr, row, stride_seed, stride_counter, token)
    tl.store(out_ptr + row * stride_out + offs, g, mask=mask)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, ids: torch.Tensor | None = None,
                 vocab: int = 0) -> torch.Tensor:
    """float32 Gumbel noise G = -log(E), E ~ Exp(1): of the token ids [B, K] (any integer dtype), or [B, vocab]
    of every token without ids; row r a function of (seeds[r], counters[r]) and the token alone (int64 seeds,
    int counters, on the device; either may be a strided view, e.g. a column of the step's metadata)."""
    B, N = seeds.shape[0], (ids.shape[1] if ids is not None else vocab)
    out = torch.empty(B, N, dtype=torch.float32, device=seeds.device)
    _noise_kernel[(B, triton.cdiv(N, BLOCK))](seeds, counters, ids, out, N, seeds.stride(0), counters.stride(0),
                                              ids.stride(0) if ids is not None else 0, out.stride(0),
                                              IDS=ids is not None, BLOCK=BLOCK, num_warps=4)
    return out
