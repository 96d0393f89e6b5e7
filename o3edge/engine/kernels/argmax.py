"""The LM head's output cast to float32 and its greedy token, in two small kernels.

torch's argmax over a 128K vocabulary runs as one long reduction per row (28 µs at batch 1 on an
H200, more than the LM head's own share of a step would suggest); here each program reduces one
chunk of the row while it writes the float32 logits, and a second kernel picks among the chunks.
Ties go to the lowest index, as torch.argmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from o3edge.engine.kernels import pdl

CHUNK = 2048


@triton.jit
def _chunk_argmax_kernel(x_ptr, out_ptr, part_val_ptr, part_idx_ptr, V, stride_x, stride_out, num_chunks,
                         CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_next(PDL)
    pdl.wait_for_previous(PDL)
    row, c = tl.program_id(0), tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < V
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=float("-inf")).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, x, mask=mask)
    best = tl.max(x, axis=0)
    idx = tl.min(tl.where(x == best, offs, V), axis=0)  # the first index holding the maximum
    tl.store(part_val_ptr + row * num_chunks + c, best)
    tl.store(part_idx_ptr + row * num_chunks + c, idx)


@triton.jit
def _pick_chunk_kernel(part_val_ptr, part_idx_ptr, token_ptr, num_chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_next(PDL)
    pdl.wait_for_previous(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < num_chunks
    vals = tl.load(part_val_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    idxs = tl.load(part_idx_ptr + row * num_chunks + offs, mask=mask, other=2147483647)
    best = tl.max(vals, axis=0)
    tl.store(token_ptr + row, tl.min(tl.where(vals == best, idxs, 2147483647), axis=0).to(tl.int64))


def float_logits_and_argmax(logits: torch.Tensor, tokens: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [B, V] any float dtype -> (float32 copy [B, V], greedy token ids int64 [B], written into
    `tokens` when given)."""
    B, V = logits.shape
    num_chunks = triton.cdiv(V, CHUNK)
    out = torch.empty(B, V, device=logits.device, dtype=torch.float32)
    part_val = torch.empty(B, num_chunks, device=logits.device, dtype=torch.float32)
    part_idx = torch.empty(B, num_chunks, device=logits.device, dtype=torch.int32)
    if tokens is None:
        tokens = torch.empty(B, device=logits.device, dtype=torch.int64)
    on = pdl.enabled(str(logits.device))
    _chunk_argmax_kernel[(B, num_chunks)](logits, out, part_val, part_idx, V, logits.stride(0), out.stride(0),
                                          num_chunks, CHUNK=CHUNK, PDL=on, num_warps=4, **pdl.launch_options(on))
    _pick_chunk_kernel[(B,)](part_val, part_idx, tokens, num_chunks,
                             BLOCK=max(16, triton.next_power_of_2(num_chunks)), PDL=on, num_warps=1,
                             **pdl.launch_options(on))
    return out, tokens
