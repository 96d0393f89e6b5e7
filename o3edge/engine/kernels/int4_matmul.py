"""Weight-only INT4 matmul (W4A16) on CUDA, from o3edge's device-neutral INT4 form.

W is stored as in quant.py: qweight uint8 [N, Kp/2] (column 2i in the high nibble, 2i+1 in the low
one) and bf16 scales_and_zeros [Kp/g, N, 2], W = (q - 8) * scale + zero per group of g columns.

- Decode-sized inputs (<= gemv.MAX_ROWS rows) run the skinny kernel (kernels/gemv.py): each weight
  byte is read once and dequantized in registers, so the step reads a quarter of fp16's bytes.
- Larger inputs (prefill) are compute-bound: the weight is dequantized into a scratch fp16/bf16 matrix
  by one streaming kernel (reading a quarter, writing the full size) and multiplied on cuBLAS; up to
  gemv.PREFILL_TILE_ROWS rows, the FFN's projections run on the skinny kernel's tiles dequantized in registers
  instead, where those were faster (gemv.prefill_tiling; O3EDGE_INT4_PREFILL_TILES=0: dequantize + cuBLAS, to
  measure against). (The first fused dequantize-in-tile GEMM was 6-25x slower than dequantize + cuBLAS
  at 128 rows: docs/benchmarks.md.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from o3edge.engine.kernels.gemv import prefill_tiling, skinny_matmul, skinny_or_dequantized, weight_tile


@triton.jit
def _dequantize_kernel(qw_ptr, sz_ptr, out_ptr, N, K, stride_qn, stride_on, GROUP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: BLOCK_N rows x BLOCK_K columns (whole groups), dequantized as the skinny kernel does."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    k0 = pid_k * BLOCK_K
    w = weight_tile(qw_ptr, sz_ptr, rn, n_mask, k0, K, N, stride_qn, True, GROUP, BLOCK_K,
                    out_ptr.dtype.element_ty)
    cols = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rn[:, None] * stride_on + cols[None, :], w, mask=n_mask[:, None] & (cols < K)[None, :])


def dequantize(qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, in_features: int,
               dtype: torch.dtype) -> torch.Tensor:
    """INT4 -> dense [N, in_features] in dtype, on the weight's device."""
    N = qweight.shape[0]
    out = torch.empty(N, in_features, device=qweight.device, dtype=dtype)
    block_k = max(256, group_size)  # whole groups
    grid = (triton.cdiv(N, 16), triton.cdiv(in_features, block_k))
    _dequantize_kernel[grid](qweight, scales_and_zeros, out, N, in_features, qweight.stride(0), out.stride(0),
                             GROUP=group_size, BLOCK_N=16, BLOCK_K=block_k, num_warps=4)
    return out


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                out_features: int) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) @ INT4 W.T -> [..., N] in x's dtype."""
    rows, K = x.numel() // x.shape[-1], x.shape[-1]
    tiling = prefill_tiling(rows, out_features, K)
    return skinny_or_dequantized(
        x, out_features, lambda x2: skinny_matmul(x2, qweight, scales_and_zeros=scales_and_zeros,
                                                  group_size=group_size, out_features=out_features, config=tiling),
        lambda dtype: dequantize(qweight, scales_and_zeros, group_size, K, dtype), tiled=tiling is not None)
