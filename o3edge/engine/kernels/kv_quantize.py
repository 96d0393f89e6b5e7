"""The token router's demotions in one kernel: full-precision KV blocks quantized into compressed blocks.

A refresh demotes ~170 blocks of the built-in long model at once. Done with torch operations
(engine/kv_quant.quantize over the gathered blocks, then two scatters), that is ~15 launches for INT8
and ~21 for INT4, whose host time made most of a demoting step's extra cost on the H200
(tools/profile_router_step.py --trace: KVRouter.flush_moves and its launches, ~0.6 ms of a 2.3 ms step,
docs/results/gpu-2026-12-03e/call1/). Here one kernel reads every source block and writes its codes and
scales to a scratch buffer, then two index copies put them in place: a source is read before anything is
written, as a block demoted in place hosts its own codes (engine/router_blocks.py).

The arithmetic is kv_quant.quantize's, step for step: the scale is the largest magnitude over qmax,
rounded to float16; codes are x / scale rounded half to even (IEEE division; the rounding by adding
and subtracting 1.5 * 2**23, exact below 2**22) and clamped. INT8 codes equal torch's bit for bit. INT4
rotates first (x @ R on the tensor cores' fp32 path here, cuBLAS or the CPU there), so a code may differ
where the rotated value sits within rounding of a half.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from o3edge.engine.kv_quant import QMAX

ROUND = 12582912.0  # 1.5 * 2**23: v + ROUND - ROUND rounds v to an integer, half to even, for |v| < 2**22
ELEMENTS = 4096  # values a program quantizes at a time (tokens x padded heads x padded head_dim)


@triton.jit(do_not_specialize=["n_moves"])  # one compiled kernel whatever the number of moves (warm_up's)
def _quantize_blocks_kernel(kv_ptr, src_ptr, rot_ptr, codes_ptr, scales_ptr, stride_plane, n_moves,
                            BS: tl.constexpr, TOK: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
                            D: tl.constexpr, DP: tl.constexpr, QMAX: tl.constexpr, INT4: tl.constexpr,
                            ROUND: tl.constexpr, TINY: tl.constexpr):
    """Program (m, plane): move m's source block in KV plane `plane` (layer * 2 + K/V), TOK tokens at a time.
    Scratch layout: codes [planes, n_moves * BS, H, D or D / 2], scales [planes, n_moves * BS, H]."""
    m, plane = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # offsets past 2**31 in a big pool
    block = tl.load(src_ptr + m).to(tl.int64)
    r = tl.arange(0, TOK * HP)
    h, d = r % HP, tl.arange(0, DP)
    row_ok = h < H
    mask = row_ok[:, None] & (d < D)[None, :]
    if INT4:
        rot = tl.load(rot_ptr + d[:, None] * D + d[None, :], mask=(d < D)[:, None] & (d < D)[None, :], other=0.0)
    for t0 in tl.static_range(0, BS, TOK):
        tok = t0 + r // HP
        src = (block * BS + tok) * H + h  # the source vector's index in its plane
        x = tl.load(kv_ptr + plane * stride_plane + src[:, None] * D + d[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        if INT4:
            x = tl.dot(x, rot, input_precision="ieee")
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), QMAX).to(tl.float16)
        s = tl.maximum(scale.to(tl.float32), TINY)
        q = (tl.math.div_rn(x, s[:, None]) + ROUND) - ROUND
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
        dst = (plane * n_moves * BS + m * BS + tok) * H + h  # the vector's index in the scratch
        tl.store(scales_ptr + dst, scale, mask=row_ok)
        if INT4:  # two's-complement nibbles, the even dimension low
            u = q.to(tl.int32) & 0xF
            lo, hi = tl.split(tl.reshape(u, [TOK * HP, DP // 2, 2]))
            e = tl.arange(0, DP // 2)
            tl.store(codes_ptr + dst[:, None] * (D // 2) + e[None, :], (lo | (hi << 4)).to(tl.uint8),
                     mask=row_ok[:, None] & (e < D // 2)[None, :])
        else:
            tl.store(codes_ptr + dst[:, None] * D + d[None, :], q.to(tl.int8), mask=mask)


def tokens_a_program(block_size: int, heads: int, head_dim: int) -> int:
    """Tokens a program quantizes at once: at most ELEMENTS values, at least 16 rows for the rotation's dot,
    and a divisor of the block size."""
    hp, dp = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim)
    tok = max(1, min(block_size, ELEMENTS // (hp * dp)))
    while tok * hp < 16 and tok < block_size:
        tok *= 2
    while block_size % tok:
        tok //= 2
    return tok


def quantize_blocks(kv: torch.Tensor, src: torch.Tensor, block_size: int, mode: str,
                    rotation: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [L, 2, slots, H, D] (contiguous), src int64 [n] full-precision block ids, on kv's device ->
    (codes [L, 2, n * block_size, H, D or D / 2] int8 or uint8, scales [L, 2, n * block_size, H] float16):
    the blocks quantized as kv_quant.quantize does, in block order."""
    L, _, slots, H, D = kv.shape
    n, int4 = src.numel(), mode == "int4"
    assert kv.is_contiguous() and D % 2 == 0
    codes = torch.empty(L, 2, n * block_size, H, D // 2 if int4 else D, device=kv.device,
                        dtype=torch.uint8 if int4 else torch.int8)
    scales = torch.empty(L, 2, n * block_size, H, device=kv.device, dtype=torch.float16)
    if n == 0:
        return codes, scales
    rot = rotation.float().contiguous() if int4 and rotation is not None else None
    if int4 and rot is None:
        rot = torch.eye(D, device=kv.device)
    tok = tokens_a_program(block_size, H, D)
    _quantize_blocks_kernel[(n, L * 2)](
        kv, src, rot, codes, scales, slots * H * D, n, BS=block_size, TOK=tok, H=H, HP=triton.next_power_of_2(H),
        D=D, DP=triton.next_power_of_2(D), QMAX=QMAX[mode], INT4=int4, ROUND=ROUND,
        TINY=float(torch.finfo(torch.float16).tiny), num_warps=4)
    return codes, scales


class PinnedStage:
    """Small int64 arrays to the device through one pinned host buffer, kept (a tensor's pin_memory() each
    time took ~0.1 ms of host time on the H200's host, and up to 3 ms when its is_pinned check was slow:
    tools/bench_demotions.py --profile, docs/results/gpu-2026-12-03e/call4/). The buffer is written again
    only once the device has read it (an event: by then long done, flushes being a step apart)."""

    def __init__(self, device: torch.device):
        self.device, self.host, self.read = device, None, None

    def to_device(self, values: np.ndarray) -> torch.Tensor:
        if self.read is not None:
            self.read.synchronize()
        n = len(values)
        if self.host is None or self.host.numel() < n:
            self.host = torch.empty(max(n, 2 * (0 if self.host is None else self.host.numel()), 4096),
                                    dtype=torch.int64, pin_memory=True)
        self.host[:n].numpy()[:] = values
        out = self.host[:n].to(self.device, non_blocking=True)
        self.read = torch.cuda.Event()
        self.read.record()
        return out


def move_blocks(kv: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, moves: np.ndarray, block_size: int,
                mode: str, rotation: torch.Tensor | None, stage: PinnedStage | None = None) -> None:
    """Quantize full-precision blocks moves[:, 0] of kv into compressed blocks moves[:, 1] (codes and scales:
    the router's views, [L, 2, compressed slots, H, *]): every source read before any destination is
    written. The block ids and destination slots go to the device in one copy (through stage on CUDA)."""
    n, bs = len(moves), block_size
    ids = np.concatenate([moves[:, 0], (moves[:, 1, None] * bs + np.arange(bs)).reshape(-1)])
    ids = stage.to_device(ids) if stage is not None else torch.from_numpy(ids).to(kv.device)
    c, s = quantize_blocks(kv, ids[:n], bs, mode, rotation)
    codes.index_copy_(2, ids[n:], c)
    scales.index_copy_(2, ids[n:], s)
