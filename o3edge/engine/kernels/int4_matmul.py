"""Weight-only INT4 matmul (W4A16) for the CUDA step: dequantized in registers, tile by tile.

y[M, N] = x[M, K] @ W.T with W stored as o3edge's device-neutral INT4 (quant.py): qweight uint8
[N, Kp/2] (column 2i in the high nibble, 2i+1 in the low one) and scales_and_zeros [Kp/g, N, 2],
W = (q - 8) * scale + zero per group of g columns. Each program reads its weight tile once and
computes x·(q - 8) on the tensor cores, then applies the group's scale and zero to the partial sums
(sum x·w = scale · sum x·(q-8) + zero · sum x), so the inner loop does no float dequantization.

One kernel serves every batch size, with its tiling chosen by rows: at M <= 16 (decode of a few
streams) it is a split-K GEMV over thin column tiles so that the weight stream fills the GPU; above,
a GEMM over wider tiles. torch's tinygemm, which this replaces on CUDA, was 6-13x slower than
fp16 at batch 32. Status: correct, but its fixed tiling is not yet faster than tinygemm, so it is
opt-in (O3EDGE_INT4_KERNEL=triton); tools/bench_int4_kernels.py compares the three per layer shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from o3edge.engine.kernels import num_sms


SPLIT_TILE_N = 128  # the column tile the split-K count is planned for


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, sz_ptr, out_ptr, M, N, K, Kp, stride_xm, stride_qn, stride_om,
                  stride_split, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, ITERS: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_K // 2)
    m_mask, n_mask = rm < M, rn < N
    dot_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(0, ITERS):  # a constant: the interpreter takes no tensor as a bound
        k0 = (pid_k * ITERS + i) * BLOCK_K
        ke = k0 + 2 * j  # even columns; odd ones are ke + 1
        xe = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :], mask=m_mask[:, None] & (ke < K)[None, :], other=0.0)
        xo = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :] + 1, mask=m_mask[:, None] & (ke + 1 < K)[None, :],
                     other=0.0)
        in_k = k0 < Kp
        q = tl.load(qw_ptr + rn[:, None] * stride_qn + (k0 // 2 + j)[None, :], mask=n_mask[:, None] & in_k,
                    other=0x88)  # [BLOCK_N, BLOCK_K/2]
        hi = ((q >> 4).to(tl.int32) - 8).to(dot_dtype)
        lo = ((q & 0xF).to(tl.int32) - 8).to(dot_dtype)
        g = k0 // GROUP
        scale = tl.load(sz_ptr + (g * N + rn) * 2, mask=n_mask & in_k, other=0.0).to(tl.float32)
        zero = tl.load(sz_ptr + (g * N + rn) * 2 + 1, mask=n_mask & in_k, other=0.0).to(tl.float32)
        if IEEE:
            part = tl.dot(xe, tl.trans(hi), input_precision="ieee") + tl.dot(xo, tl.trans(lo), input_precision="ieee")
        else:
            part = tl.dot(xe, tl.trans(hi)) + tl.dot(xo, tl.trans(lo))
        xsum = tl.sum(xe.to(tl.float32), axis=1) + tl.sum(xo.to(tl.float32), axis=1)
        acc += part * scale[None, :] + xsum[:, None] * zero[None, :]
    dst = out_ptr + pid_k * stride_split + rm[:, None] * stride_om + rn[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLITS):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def plan(M: int, N: int, Kp: int, group: int, num_sms: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, split_k): thin split-K row tiles at M <= 16, wider GEMM tiles above."""
    block_k = min(group, 128)  # one scale and zero per row of a tile
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    tiles = -(-M // block_m) * -(-N // SPLIT_TILE_N)
    steps = Kp // block_k
    split = 1
    while tiles * split < 2 * num_sms and split * 2 <= steps // 2 and M <= 64:
        split *= 2  # enough programs for the weight stream to fill every SM, at least 2 steps each
    return block_m, block_k, split


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                out_features: int) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) @ INT4 W.T -> [..., N] in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    N, Kp = out_features, 2 * qweight.shape[1]
    bm, bk, split = plan(M, N, Kp, group_size, num_sms(str(x.device)))
    iters = -(-(Kp // bk) // split)
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    part = out if split == 1 else torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    args = (x2, qweight, scales_and_zeros, part, M, N, K, Kp, x2.stride(0), qweight.stride(0), N, M * N)
    meta = dict(GROUP=group_size, BLOCK_M=bm, BLOCK_K=bk, ITERS=iters, IEEE=x.dtype == torch.float32)
    bn = SPLIT_TILE_N if M > 16 else 64
    _w4a16_kernel[(-(-M // bm), -(-N // bn), split)](*args, BLOCK_N=bn, **meta, num_warps=4, num_stages=3)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, 1024),)](part, out, M * N, SPLITS=split, BLOCK=1024, num_warps=4)
    return out.view(*shape[:-1], N)
