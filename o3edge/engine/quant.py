"""Weight-only group-wise INT4 for the FFN projections, as a module swap over torch's own kernels.

The scheme is the one torch's int4pack kernels (and gpt-fast) expect: for each output row and each
group of `group_size` input columns, q = round((w - min) / scale) in [0, 15] and the kernels
dequantize w ~ (q - 8) * scale + zero, with zero = min + 8 * scale; scale and zero are bf16.

On disk the weight stays device-independent: `qweight` uint8 [N, Kp/2] (column 2i in the high
nibble, 2i+1 in the low one, as `_convert_weight_to_int4pack` reads it) and `scales_and_zeros`
bf16 [Kp/group, N, 2]. Kp is K padded with zero columns to a multiple of the group size. The
tile layouts the kernels run on differ by device (and by CPU instruction set), so `Int4Linear`
packs at load time, which costs milliseconds.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from o3edge.config import INT4_GROUP_SIZES as GROUP_SIZES
from o3edge.engine.manifest import INT4_SCHEME

log = logging.getLogger(__name__)

SCHEME = INT4_SCHEME
FFN_MODULES = ("mlp.gate_up", "mlp.down")
INNER_K_TILES = 8  # CUDA: 8 k-tiles of 16 per 16-byte load, so K must be a multiple of 128
_CUDA_K_MULTIPLE = INNER_K_TILES * 16
_N_MULTIPLE = 16  # the CPU packer wants N % 16 == 0 (CUDA: % 8)
# On CUDA, INT4 runs o3edge's Triton kernels (kernels/int4_matmul.py) on the device-neutral form;
# O3EDGE_INT4_KERNEL=tinygemm packs for torch's tinygemm instead (for comparison, tools/bench_gemv.py).
TINYGEMM = os.environ.get("O3EDGE_INT4_KERNEL") == "tinygemm"


def padded_k(in_features: int, multiple: int) -> int:
    return -(-in_features // multiple) * multiple


def can_quantize(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether torch's packers take this shape (rows are never padded, columns are)."""
    return out_features % _N_MULTIPLE == 0 and in_features >= 2 and group_size in GROUP_SIZES


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (qweight uint8 [N, Kp/2], scales_and_zeros bf16 [Kp/g, N, 2])."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group size must be one of {GROUP_SIZES}, got {group_size}")
    N, K = weight.shape
    Kp = padded_k(K, group_size)
    w = F.pad(weight.float(), (0, Kp - K)).view(N, Kp // group_size, group_size)  # [N, G, g]
    scale, zero = minmax_scale_zero(w)
    return pack_int4(int4_levels(w, scale, zero).view(N, Kp), scale.view(N, -1), zero.view(N, -1))


def minmax_scale_zero(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (scale, zero) [..., 1] from its min and max, rounded to bf16 first (the values the kernels use)."""
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo).clamp(min=1e-6) / 15).to(torch.bfloat16).float()
    return scale, (lo + 8 * scale).to(torch.bfloat16).float()


def int4_levels(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The stored q in 0..15 (as floats) of weights w for the kernels' (q - 8) * scale + zero."""
    return ((w - zero) / scale).round().add(8).clamp(0, 15)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Kp] in 0..15, scale and zero [N, G] -> the on-disk (qweight uint8 [N, Kp/2], scales_and_zeros bf16)."""
    q = q.to(torch.uint8)
    qweight = (q[:, 0::2] << 4) | q[:, 1::2]  # [N, Kp/2]
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1)  # [G, N, 2]
    return qweight.contiguous(), sz.to(torch.bfloat16).contiguous()


def unpack_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, Kp/2] -> int32 [N, Kp] with values 0..15."""
    return torch.stack([qweight >> 4, qweight & 0xF], dim=-1).view(qweight.shape[0], -1).to(torch.int32)


def dequantize_int4(qweight: torch.Tensor, scales_and_zeros: torch.Tensor, in_features: int) -> torch.Tensor:
    """The float32 weight [N, K] the kernels compute with: (q - 8) * scale + zero."""
    q = unpack_nibbles(qweight).float()  # [N, Kp]
    N, Kp = q.shape
    G = scales_and_zeros.shape[0]
    sz = scales_and_zeros.float().transpose(0, 1)  # [N, G, 2]
    w = (q.view(N, G, Kp // G) - 8) * sz[..., :1] + sz[..., 1:]
    return w.view(N, Kp)[:, :in_features]


def _pack_for_device(qweight: torch.Tensor, sz: torch.Tensor, group_size: int):
    """Device-neutral (qweight, scales_and_zeros) -> what the device's int4 matmul reads."""
    if qweight.device.type == "cuda" and not TINYGEMM:  # the Triton kernels read the device-neutral form
        return qweight.contiguous(), sz.to(torch.bfloat16).contiguous(), 2 * qweight.shape[1]
    if qweight.device.type == "cuda":
        N, half = qweight.shape
        Kc = padded_k(2 * half, _CUDA_K_MULTIPLE)
        if Kc != 2 * half:  # whole zero groups: scale 0 and zero 0 dequantize to exactly 0
            qweight = F.pad(qweight, (0, Kc // 2 - half))
            sz = F.pad(sz, (0, 0, 0, 0, 0, Kc // group_size - sz.shape[0]))
        packed = torch.ops.aten._convert_weight_to_int4pack(qweight.contiguous(), INNER_K_TILES)
        return packed, sz.to(torch.bfloat16).contiguous(), Kc
    if qweight.device.type != "cpu":
        raise NotImplementedError(f"INT4 has no kernel on {qweight.device.type}")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(qweight).contiguous(), INNER_K_TILES)
    return packed, sz.to(torch.bfloat16).contiguous(), 2 * qweight.shape[1]


class Int4Linear(nn.Module):
    """A bias-free nn.Linear whose weight is group-wise INT4, run by torch's int4pack matmul.

    The kernels take bf16 activations (the CPU one has vector paths only for bf16 on x86), so
    other dtypes are cast around the call; the result comes back in the input's dtype.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int):
        super().__init__()
        if not can_quantize(out_features, in_features, group_size):
            raise ValueError(f"cannot INT4-pack a {out_features}x{in_features} weight with group {group_size}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.k_padded = padded_k(in_features, group_size)  # the kernel's K, set for the device by load_quantized
        self.register_buffer("weight", torch.empty(0, dtype=torch.uint8), persistent=False)
        self.register_buffer("scales_and_zeros", torch.empty(0, dtype=torch.bfloat16), persistent=False)
        self.neutral = False  # weight in the device-neutral form, run by o3edge's Triton kernels (CUDA)
        self.vnni = False  # CPU: o3edge's VNNI kernel (cpu_ext.py) on rows16 weights, [2, G, N] scales/zeros

    def load_quantized(self, qweight: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        """Pack the on-disk form for the device qweight lives on (cpu or cuda)."""
        Kp = self.k_padded
        if tuple(qweight.shape) != (self.out_features, Kp // 2) or qweight.dtype != torch.uint8:
            raise ValueError(f"qweight must be uint8 {(self.out_features, Kp // 2)}, got "
                             f"{qweight.dtype} {tuple(qweight.shape)}")
        if tuple(scales_and_zeros.shape) != (Kp // self.group_size, self.out_features, 2):
            raise ValueError(f"scales_and_zeros must be {(Kp // self.group_size, self.out_features, 2)}, "
                             f"got {tuple(scales_and_zeros.shape)}")
        from o3edge.engine.cpu_quant import vnni_fits

        self.vnni = qweight.device.type == "cpu" and vnni_fits(self.out_features, 8)
        if self.vnni:
            self.weight = torch.ops.o3edge_cpu.int4_pack_rows16(qweight)
            self.scales_and_zeros = scales_and_zeros.to(torch.bfloat16).permute(2, 0, 1).contiguous()
            return
        self.weight, self.scales_and_zeros, self.k_padded = _pack_for_device(
            qweight, scales_and_zeros.to(qweight.device), self.group_size)
        self.neutral = qweight.device.type == "cuda" and not TINYGEMM

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        if self.neutral:
            from o3edge.engine.kernels.int4_matmul import int4_matmul

            return int4_matmul(x, self.weight, self.scales_and_zeros, self.group_size, self.out_features)
        if self.vnni:
            y = torch.ops.o3edge_cpu.int4_linear(x, self.weight, self.scales_and_zeros[0], self.scales_and_zeros[1],
                                                  self.group_size, self.out_features)
            return y.to(x.dtype)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.k_padded != self.in_features:
            x2 = F.pad(x2, (0, self.k_padded - self.in_features))
        x2 = x2.to(torch.bfloat16).contiguous()
        if x2.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(x2, self.weight, self.group_size, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight, self.group_size, self.scales_and_zeros)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


def int4_linears(model: nn.Module, every_linear: bool = False) -> dict[str, nn.Linear]:
    """The linears INT4 applies to, by module name: the FFN projections (layers.i.mlp.gate_up / .down), or
    with every_linear all of them (the attention projections and an untied LM head too)."""
    return {name: mod for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and (every_linear or name.endswith(FFN_MODULES))}


def quantizable(model: nn.Module, group_size: int, every_linear: bool = False) -> list[str]:
    """Names of the linears (int4_linears) whose shapes torch's INT4 packers accept."""
    names = []
    for name, mod in int4_linears(model, every_linear).items():
        if can_quantize(mod.out_features, mod.in_features, group_size) and mod.bias is None:
            names.append(name)
        else:
            log.warning("%s (%dx%d) stays dense: INT4 needs a bias-free layer with rows in multiples of %d",
                        name, mod.out_features, mod.in_features, _N_MULTIPLE)
    return names


def swap_modules(model: nn.Module, names: list[str], make) -> dict[str, nn.Module]:
    """Put make(old) in place of each named submodule (old may be None, e.g. a tied LM head)."""
    swapped = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        swapped[name] = make(getattr(parent, child))
        setattr(parent, child, swapped[name])
    return swapped


def swap_to_int4(model: nn.Module, names: list[str], group_size: int) -> dict[str, Int4Linear]:
    """Replace the named nn.Linear modules (or a tied LM head's None) by empty Int4Linear ones (call under
    torch.device('meta'))."""
    def make(old):
        n, k = model.embed.weight.shape if old is None else (old.out_features, old.in_features)
        return Int4Linear(k, n, group_size)

    return swap_modules(model, names, make)


def int4_tag(model: nn.Module) -> str:
    """A short identity of the model's quantization ('' when dense), for cache keys and logs."""
    int4 = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    groups = sorted({m.group_size for m in int4.values()})
    attention = any(not name.endswith(FFN_MODULES) and name != "lm_head" for name in int4)
    return "".join(f":int4g{g}" for g in groups) + (":all" if attention else ":head" if "lm_head" in int4 else "")
