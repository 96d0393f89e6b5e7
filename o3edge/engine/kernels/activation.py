"""SiLU(gate) * up over the fused gate_up projection's output, in one kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from o3edge.engine.kernels import pdl


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_next(PDL)
    pdl.wait_for_previous(PDL)
    row, col = tl.program_id(0), tl.program_id(1)
    offs = col * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)  # silu rounded, as eager does
    tl.store(out_ptr + row * stride_out + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


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
