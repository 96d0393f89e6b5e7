"""INT8 matmul by Triton, from the per-row INT8 form of cpu_quant.py.

W is stored as int8 codes q [N, K] and float32 scales [N], w = q * scale per output row; x and the
result are in the model dtype (float16, bfloat16; float32 under Triton's interpreter).

- Decode-sized inputs (<= gemv.MAX_ROWS rows) run the skinny kernel (kernels/gemv.py): each weight
  byte is read once and each output scaled once, so a step reads half of fp16's bytes for these
  layers. One row is quantized per 32 columns and multiplied by dp4a (gemv.dp4a_int8); more rows
  multiply the codes made half precision on the tensor cores (W8A16).
- Larger inputs (prefill) are compute-bound: the weight is dequantized into a scratch matrix in the
  model dtype by one streaming kernel and multiplied on cuBLAS, as int4_matmul.py does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from o3edge.engine.kernels.gemv import skinny_matmul, skinny_or_dequantized


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: BLOCK_N rows x BLOCK_K columns of q * scale, rounded once to the output dtype."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    offs = rn.to(tl.int64)[:, None] * K + rk[None, :]
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    tl.store(out_ptr + offs, (q * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """INT8 codes [N, K] and scales [N] -> dense [N, K] in dtype, on the codes' device."""
    N, K = q.shape
    out = torch.empty(N, K, device=q.device, dtype=dtype)
    grid = (triton.cdiv(N, 16), triton.cdiv(K, 256))
    _dequantize_kernel[grid](q, scales, out, N, K, BLOCK_N=16, BLOCK_K=256, num_warps=4)
    return out


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (q * scales[:, None]).T -> [..., N] in x's dtype."""
    return skinny_or_dequantized(x, q.shape[0], lambda x2: skinny_matmul(x2, q, scales8=scales),
                                 lambda dtype: dequantize(q, scales, dtype))
