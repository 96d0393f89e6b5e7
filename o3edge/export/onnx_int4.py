"""INT4 FFN weights in the ONNX export: ONNX Runtime's MatMulNBits (com.microsoft), 4 bits, one
scale and zero point per group of columns, as o3edge's own INT4 scheme (engine/quant.py).

During export each INT4 projection is an `o3edge::matmul_nbits` op whose ONNX symbolic emits
MatMulNBits; its torch implementation (used while tracing) multiplies by the dequantized weight.
o3edge stores W = (q - 8) * scale + zero with the even column in the high nibble; MatMulNBits reads
W = (q - zp) * scale with the even column in the low nibble, so the nibbles are swapped and the
zero point becomes the float zp = 8 - zero / scale.
"""

from __future__ import annotations

import torch
from torch import nn

from o3edge.engine.quant import quantize_int4

_OP = "o3edge::matmul_nbits"
_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from torch.onnx import register_custom_op_symbolic
    from torch.onnx.symbolic_helper import parse_args

    torch.library.define(_OP, "(Tensor x, Tensor b, Tensor scales, Tensor zp, int K, int N, int block) -> Tensor")

    @torch.library.impl(_OP, "cpu")
    def _matmul_nbits(x, b, scales, zp, K, N, block):
        low, high = (b & 0xF).to(torch.float32), (b >> 4).to(torch.float32)  # [N, groups, block/2]
        q = torch.stack((low, high), dim=-1).reshape(N, -1)  # columns in order
        groups = q.shape[1] // block
        w = (q.view(N, groups, block) - zp.view(N, groups, 1)) * scales.view(N, groups, 1)
        return torch.matmul(x, w.reshape(N, -1)[:, :K].to(x.dtype).T)

    @parse_args("v", "v", "v", "v", "i", "i", "i")
    def _symbolic(g, x, b, scales, zp, K, N, block):
        return g.op("com.microsoft::MatMulNBits", x, b, scales, zp, K_i=K, N_i=N, bits_i=4, block_size_i=block)

    register_custom_op_symbolic(_OP, _symbolic, 1)
    _registered = True


class NBitsLinear(nn.Module):
    """A bias-free linear layer in MatMulNBits form (for export only)."""

    def __init__(self, weight: torch.Tensor, group_size: int, dtype: torch.dtype):
        super().__init__()
        _register()
        qweight, sz = quantize_int4(weight, group_size)  # the same q, scale, zero the torch engine uses
        N, K = weight.shape
        groups = sz.shape[0]
        swapped = ((qweight & 0xF) << 4) | (qweight >> 4)  # even column to the low nibble
        self.register_buffer("b", swapped.view(N, groups, group_size // 2).contiguous())
        scale, zero = sz[..., 0].float().T.contiguous(), sz[..., 1].float().T.contiguous()  # [N, groups]
        zp = torch.where(scale > 0, 8 - zero / scale.clamp(min=1e-30), torch.full_like(scale, 8.0))
        self.register_buffer("scales", scale.reshape(-1).to(dtype))
        self.register_buffer("zp", zp.reshape(-1).to(dtype))
        self.K, self.N, self.block = K, N, group_size

    def forward(self, x):
        return torch.ops.o3edge.matmul_nbits(x, self.b, self.scales, self.zp, self.K, self.N, self.block)


def swap_ffn_to_nbits(model: nn.Module, group_size: int) -> int:
    """Replace the FFN projections (dense nn.Linear) by NBitsLinear; returns how many were swapped."""
    from o3edge.engine.quant import quantizable, swap_modules

    make = lambda old: NBitsLinear(old.weight.detach().float(), group_size, old.weight.dtype)  # noqa: E731
    return len(swap_modules(model, quantizable(model, group_size), make))
