"""SiLU(gate) * up over the fused gate_up projection's output, in one kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from o3edge.engine.kernels import pdl


@triton.jit
def silu_mul_rounded(gate, up, dtype: tl.constexpr):
    """SiLU(gate) * up as eager torch computes it in `dtype`: the SiLU rounded to dtype, then the product
    (gate and up as stored, in dtype). The SiLU·mul kernel, and the skinny matmuls that fuse it before
    (down's prologue) or after (gate/up's epilogue: kernels/gemv.py), all round this way."""
    g = gate.to(tl.float32)
    return ((g * tl.sigmoid(g)).to(dtype).to(tl.float32) * up.to(tl.float32)).to(dtype)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_next(PDL)
    pdl.wait_for_previous(PDL)
    row, col = tl.program_id(0), tl.program_id(1)
    offs = col * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + inter + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + offs, silu_mul_rounded(g, u, out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate first) -> [T, I]."""
    T, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(T, inter, device=gate_up.device, dtype=gate_up.dtype)
    block = min(1024, triton.next_power_of_2(inter))
    on = pdl.enabled(str(gate_up.device))
    _silu_mul_kernel[(T, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                      BLOCK=block, PDL=on, num_warps=4, **pdl.launch_options(on))
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
