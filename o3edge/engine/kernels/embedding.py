"""The decode step's input embeddings, each row's token taken from the step metadata or from the step before.

A step launched ahead (cuda_graph.py) takes as input tokens the greedy tokens of the step queued before
it, which the host has not seen yet: a row's metadata token is then -(r + 1), the token being row r of the
previous step's greedy output, on the device (`last`). One kernel resolves that and gathers the embedding
row, inside the step's graph (the graph copies its metadata in itself: no cast copy into the metadata runs
between two graphs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from o3edge.engine.kernels import pdl

BLOCK = 1024


@triton.jit
def _embed_rows_kernel(w_ptr, meta_ptr, last_ptr, out_ptr, D, stride_meta, stride_w, stride_out,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_next(PDL)
    pdl.wait_for_previous(PDL)  # the metadata copy and the previous step's tokens come before
    row, c = tl.program_id(0), tl.program_id(1)
    src = tl.load(meta_ptr + row * stride_meta).to(tl.int64)
    prev = tl.load(last_ptr + tl.maximum(-src - 1, 0))
    token = tl.where(src >= 0, src, prev)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    tl.store(out_ptr + row * stride_out + cols, tl.load(w_ptr + token * stride_w + cols, mask=mask), mask=mask)


def embed_rows(weight: torch.Tensor, meta: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """weight [V, D], meta [B, *] int32 (column 0: a token id, or -(r + 1) for row r of last), last [>= r]
    int64 -> embeddings [B, D] in weight's dtype."""
    B, D = meta.shape[0], weight.shape[1]
    out = torch.empty(B, D, device=weight.device, dtype=weight.dtype)
    on = pdl.enabled(str(weight.device))
    _embed_rows_kernel[(B, triton.cdiv(D, BLOCK))](weight, meta, last, out, D, meta.stride(0), weight.stride(0),
                                                   out.stride(0), BLOCK=BLOCK, PDL=on, num_warps=4,
                                                   **pdl.launch_options(on))
    return out


def embed_rows_reference(weight: torch.Tensor, meta: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    src = meta[:, 0].long()
    return weight[torch.where(src >= 0, src, last[(-src - 1).clamp_min(0)])]
