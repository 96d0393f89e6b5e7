"""Weight-only INT4 matmul (W4A16) on CUDA, from o3edge's device-neutral INT4 form.

W is stored as in quant.py: qweight uint8 [N, Kp/2] (column 2i in the high nibble, 2i+1 in the low
one) and bf16 scales_and_zeros [Kp/g, N, 2], W = (q - 8) * scale + zero per group of g columns.

- Decode-sized inputs (<= gemv.MAX_ROWS rows) run the skinny kernel (kernels/gemv.py): each weight
  byte is read once and dequantized in registers, so the step reads a quarter of fp16's bytes.
- Larger inputs (prefill) are compute-bound: the weight is dequantized into a scratch fp16/bf16 matrix
  by one streaming kernel (reading a quarter, writing the full size) and multiplied on cuBLAS. A fused
  dequantize-in-tile GEMM was 6-25x slower than that at 128 rows (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _dequantize_kernel(qw_ptr, sz_ptr, out_ptr, N, K, stride_qn, stride_on, GROUP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """One program: BLOCK_N rows x BLOCK_G groups of columns."""
    pid_n, pid_g = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    g = pid_g * BLOCK_G + tl.arange(0, BLOCK_G)
    j = tl.arange(0, GROUP // 2)
    n_mask = rn < N
    g_mask = g * GROUP < K
    q = tl.load(qw_ptr + rn[:, None, None] * stride_qn + (g * (GROUP // 2))[None, :, None] + j[None, None, :],
                mask=n_mask[:, None, None] & g_mask[None, :, None], other=0x88)
    sz = sz_ptr + (g[None, :] * N + rn[:, None]) * 2
    scale = tl.load(sz, mask=n_mask[:, None] & g_mask[None, :], other=0.0).to(tl.float32)[:, :, None]
    zero = tl.load(sz + 1, mask=n_mask[:, None] & g_mask[None, :], other=0.0).to(tl.float32)[:, :, None]
    hi = ((q >> 4).to(tl.int32) - 8).to(tl.float32) * scale + zero
    lo = ((q & 0xF).to(tl.int32) - 8).to(tl.float32) * scale + zero
    w = tl.reshape(tl.join(hi, lo), [BLOCK_N, BLOCK_G * GROUP])
    cols = (pid_g * BLOCK_G * GROUP + tl.arange(0, BLOCK_G * GROUP))
    tl.store(out_ptr + rn[:, None] * stride_on + cols[None, :], w.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & (cols < K)[None, :])


def dequantize(qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, in_features: int,
               dtype: torch.dtype) -> torch.Tensor:
    """INT4 -> dense [N, in_features] in dtype, on the weight's device."""
    N = qweight.shape[0]
    out = torch.empty(N, in_features, device=qweight.device, dtype=dtype)
    block_g = max(1, 256 // group_size)
    grid = (triton.cdiv(N, 16), triton.cdiv(triton.cdiv(in_features, group_size), block_g))
    _dequantize_kernel[grid](qweight, scales_and_zeros, out, N, in_features, qweight.stride(0), out.stride(0),
                             GROUP=group_size, BLOCK_N=16, BLOCK_G=block_g, num_warps=4)
    return out


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                out_features: int) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) @ INT4 W.T -> [..., N] in x's dtype."""
    from o3edge.engine.kernels.gemv import MAX_ROWS, skinny_matmul

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] <= MAX_ROWS:
        y = skinny_matmul(x2, qweight, scales_and_zeros=scales_and_zeros, group_size=group_size,
                          out_features=out_features)
    else:
        y = F.linear(x2, dequantize(qweight, scales_and_zeros, group_size, x2.shape[1], x2.dtype))
    return y.view(*shape[:-1], out_features)
