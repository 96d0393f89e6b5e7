"""Compressed KV storage: INT8 per (token, head), INT4 per (token, head) after a Hadamard rotation.

Each cached key or value vector (one token, one KV head, head_dim numbers) gets one float16 scale
and symmetric integer codes: INT8 in [-127, 127], INT4 in [-7, 7] packed two to a byte (low nibble:
even dimension). Before INT4 quantization a vector is multiplied by the normalised Hadamard matrix
R (orthonormal and symmetric, R @ R = I): the rotation spreads an outlier channel over every
dimension, so one scale fits all of them (vLLM's int4_per_token_head does the same). Attention does
not need to undo the rotation on keys, since q . k = (q R) . (k R): the query is rotated once per
step instead; values come out of attention rotated, and one product with R per head restores them.
"""

from __future__ import annotations

import functools
import math

import torch

MODES = ("int8", "int4")
QMAX = {"int8": 127, "int4": 7}


def code_dim(mode: str, head_dim: int) -> int:
    """Bytes of codes per vector."""
    return head_dim if mode == "int8" else head_dim // 2


def bytes_per_vector(mode: str, head_dim: int) -> int:
    """Codes plus the float16 scale."""
    return code_dim(mode, head_dim) + 2


def hadamard(n: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix [n, n]: orthonormal and symmetric. When n is not a power
    of two (Qwen3's head_dim 96...), the block-diagonal one of its largest power-of-two factor."""
    p = n & -n  # largest power of two dividing n
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < p:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    h = torch.block_diag(*[h / math.sqrt(p)] * (n // p))
    return h.to(dtype=dtype, device=device)


def quantize(x: torch.Tensor, mode: str, rotation: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., hd] float -> (codes int8 [..., hd] (int8) or uint8 [..., hd/2] (int4), scales float16 [...]).

    With int4, `rotation` ([hd, hd], from `hadamard`) is applied first."""
    x = x.float()
    if mode == "int4" and rotation is not None:
        x = x @ rotation.float()
    qmax = QMAX[mode]
    scale = (x.abs().amax(dim=-1) / qmax).to(torch.float16)
    s = scale.float().clamp_min(torch.finfo(torch.float16).tiny)  # the scale as stored divides
    q = torch.round(x / s[..., None]).clamp_(-qmax, qmax)
    if mode == "int8":
        return q.to(torch.int8), scale
    u = (q.to(torch.int16) & 0xF).to(torch.uint8)  # two's-complement nibbles
    return u[..., 0::2] | (u[..., 1::2] << 4), scale


@functools.lru_cache(maxsize=None)
def _nibbles(device: str) -> torch.Tensor:
    """float32 [256, 2] on device: a byte's two's-complement nibbles, the low one (even dimension) first."""
    return torch.tensor([[((b & 0xF) ^ 8) - 8, ((b >> 4) ^ 8) - 8] for b in range(256)], dtype=torch.float32,
                        device=device)


def unpack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., hd/2] -> float32 [..., hd] in [-8, 7]: one table lookup a byte (with shifts, masks and a
    stack instead, the CPU router's INT4 decode ran at 0.48x of full precision's speed against 0.68x:
    tools/bench_router.py --speed, docs/benchmarks.md)."""
    table = _nibbles(str(codes.device))
    return table.index_select(0, codes.reshape(-1).long()).view(*codes.shape[:-1], 2 * codes.shape[-1])


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mode: str, rotation: torch.Tensor | None = None,
               unrotate: bool = True) -> torch.Tensor:
    """The float32 vectors the codes stand for. With int4 and a rotation, unrotate=False keeps them
    in the rotated basis (what attention uses: queries rotated instead of keys)."""
    q = codes.float() if mode == "int8" else unpack_int4(codes)
    x = q * scales.float()[..., None]
    if mode == "int4" and rotation is not None and unrotate:
        x = x @ rotation.float()  # R is its own inverse
    return x
