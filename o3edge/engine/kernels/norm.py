"""Residual add fused with RMSNorm: one kernel where eager torch runs eight."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from o3edge.engine.kernels import pdl


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride, D, eps,
                        BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_next(PDL)
    pdl.wait_for_previous(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride + offs, mask=mask, other=0.0)
    if HAS_RES:
        # the sum is rounded to the model dtype before the norm reads it, as the eager model does
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    y = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, residual: [T, D]. With a residual: residual += x in place, return rmsnorm(residual) * weight;
    without: return rmsnorm(x) * weight."""
    T, D = x.shape
    out = torch.empty_like(x)
    block = triton.next_power_of_2(D)
    on = pdl.enabled(str(x.device))
    _add_rmsnorm_kernel[(T,)](x, residual if residual is not None else x, weight, out, x.stride(0), D, eps,
                              BLOCK=block, HAS_RES=residual is not None, PDL=on,
                              num_warps=min(16, max(1, block // 256)), **pdl.launch_options(on))
    return out


def add_rmsnorm_reference(x, residual, weight, eps):
    """What add_rmsnorm computes, in plain torch (the eager model's rounding)."""
    if residual is not None:
        residual.copy_(x + residual)
        x = residual
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
