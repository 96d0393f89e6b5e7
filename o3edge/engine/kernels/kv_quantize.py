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

from o3edge.engine.kernels import cuda_index
from o3edge.engine.kv_quant import QMAX

ROUND = 12582912.0  # 1.5 * 2**23: v + ROUND - ROUND rounds v to an integer, half to even, for |v| < 2**22
ELEMENTS = 4096  # values a program quantizes at a time (tokens x padded heads x padded head_dim)


@triton.jit(do_not_specialize=["n_moves"])  # one compiled kernel whatever the number of moves (warm_up's)
def _quantize_blocks_kernel(kv_ptr, src_ptr, rot_ptr, codes_ptr, scales_ptr, stride_plane, n_moves, count_ptr,
                            BS: tl.constexpr, TOK: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
                            D: tl.constexpr, DP: tl.constexpr, QMAX: tl.constexpr, INT4: tl.constexpr,
                            ROUND: tl.constexpr, TINY: tl.constexpr, COUNTED: tl.constexpr):
    """Program (m, plane): move m's source block in KV plane `plane` (layer * 2 + K/V), TOK tokens at a time.
    Scratch layout: codes [planes, n_moves * BS, H, D or D / 2], scales [planes, n_moves * BS, H]. COUNTED:
    only the first count_ptr[0] of the n_moves moves are real (a captured graph's fixed grid); the rest do
    nothing."""
    m, plane = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # offsets past 2**31 in a big pool
    r = tl.arange(0, TOK * HP)
    h, d = r % HP, tl.arange(0, DP)
    if COUNTED:
        live = m < tl.load(count_ptr)
        block = tl.load(src_ptr + m, mask=live, other=0).to(tl.int64)
        row_ok = (h < H) & live
    else:
        block = tl.load(src_ptr + m).to(tl.int64)
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
    rot = _rotation(kv, mode, rotation)
    _launch_quantize(kv, src, rot, codes, scales, n, None, block_size, mode)
    return codes, scales


def _rotation(kv: torch.Tensor, mode: str, rotation: torch.Tensor | None) -> torch.Tensor | None:
    """The kernel's rotation operand: INT4's Hadamard in float32 (the identity without one), None for INT8."""
    if mode != "int4":
        return None
    return rotation.float().contiguous() if rotation is not None else torch.eye(kv.shape[-1], device=kv.device)


def _launch_quantize(kv, src, rot, codes, scales, n: int, count: torch.Tensor | None, block_size: int,
                     mode: str) -> None:
    """The quantizing kernel over n moves (count: only its first count[0] real, on the device)."""
    L, _, slots, H, D = kv.shape
    _quantize_blocks_kernel[(n, L * 2)](
        kv, src, rot, codes, scales, slots * H * D, n, src if count is None else count, BS=block_size,
        TOK=tokens_a_program(block_size, H, D), H=H, HP=triton.next_power_of_2(H), D=D,
        DP=triton.next_power_of_2(D), QMAX=QMAX[mode], INT4=mode == "int4", ROUND=ROUND,
        TINY=float(torch.finfo(torch.float16).tiny), COUNTED=count is not None, num_warps=4)


class PinnedStage:
    """Small int64 arrays to the device through one pinned host buffer, kept (a tensor's pin_memory() each
    time took ~0.1 ms of host time on the H200's host, and up to 3 ms when its is_pinned check was slow:
    tools/bench_demotions.py --profile, docs/results/gpu-2026-12-03e/call4/). The buffer is written again
    only once the device has read it (an event: by then long done, flushes being a step apart)."""

    def __init__(self, device: torch.device):
        self.device, self.host, self.read = device, None, None
        self.stream_index = cuda_index(device)

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
        self.read.record(torch.cuda.current_stream(self.stream_index))
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


@triton.jit
def _place_blocks_kernel(src_codes_ptr, src_scales_ptr, dst_ptr, count_ptr, codes_ptr, scales_ptr,
                         codes_plane, scales_plane, n_moves, ROW: tl.constexpr, SROW: tl.constexpr,
                         CHUNK: tl.constexpr, SCHUNK: tl.constexpr):
    """Program (m, plane): move m's codes (ROW bytes a block and plane) and scales (SROW values) from the
    scratch ([planes, n_moves, ROW] and [planes, n_moves, SROW]) to compressed block dst_ptr[m] of the pool
    (planes codes_plane and scales_plane elements apart); nothing when m is past count_ptr[0]."""
    m, plane = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    if m < tl.load(count_ptr):
        dst = tl.load(dst_ptr + m).to(tl.int64)
        src = (plane * n_moves + m) * ROW
        out = plane * codes_plane + dst * ROW
        for off in tl.static_range(0, ROW, CHUNK):
            i = off + tl.arange(0, CHUNK)
            tl.store(codes_ptr + out + i, tl.load(src_codes_ptr + src + i, mask=i < ROW), mask=i < ROW)
        src = (plane * n_moves + m) * SROW
        out = plane * scales_plane + dst * SROW
        for off in tl.static_range(0, SROW, SCHUNK):
            i = off + tl.arange(0, SCHUNK)
            tl.store(scales_ptr + out + i, tl.load(src_scales_ptr + src + i, mask=i < SROW), mask=i < SROW)


def moves_a_replay(num_layers: int, block_size: int, heads: int, head_dim: int, mode: str,
                   scratch_bytes: int = 16 << 20) -> int:
    """Moves one MoveGraph replay carries (its scratch holds that many blocks' codes and scales): as many as
    scratch_bytes hold, between 16 and 256 (the built-in long model: 248, llama-1b: 31)."""
    per_move = num_layers * 2 * block_size * heads * ((head_dim // 2 if mode == "int4" else head_dim) + 2)
    return max(16, min(256, scratch_bytes // per_move))


class MoveGraph:
    """A flush's demotions as one CUDA graph replay for every `capacity` moves (on CUDA, unless
    O3EDGE_ROUTER_MOVE_GRAPH=0), instead of move_blocks' ids copy, two scratch allocations, the kernel's launch
    and two index copies. On the H200's host a flush of 170 moves took 1.13 ms of host time that way and 0.45 ms
    by the graph (tools/bench_demotions.py --mode int8; docs/results/gpu-2026-12-05/call1/). The graph copies a
    pinned host buffer (the number of moves, the sources, the destinations) to the device, quantizes the sources
    into a scratch that lives with it, then places the codes and scales: every source of a replay read before any
    of its destinations is written, as move_blocks does. Replays run in stream order, so a later one's sources,
    never a block hosting codes (those are demoted already), are read after an earlier one's writes without harm.
    Two host buffers, used in turn, each written again only once the device has read it (an event). Without
    capture (CPU tests under Triton's interpreter) the same three operations run one by one."""

    def __init__(self, kv: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_size: int, mode: str,
                 rotation: torch.Tensor | None, capacity: int, capture: bool):
        L, _, _, H, D = kv.shape
        self.kv, self.codes, self.scales, self.bs, self.mode = kv, codes, scales, block_size, mode
        self.capacity, cuda = capacity, kv.device.type == "cuda"
        self.stream_index = cuda_index(kv.device)  # the replays' events' stream, by index
        self.rot = _rotation(kv, mode, rotation)
        self.ids = torch.zeros(1 + 2 * capacity, dtype=torch.int64, device=kv.device)  # count, sources, dests
        self.host = [torch.zeros(1 + 2 * capacity, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.read: list = [None, None]
        self.scratch_codes = torch.empty(L, 2, capacity * block_size, H, codes.shape[-1], dtype=codes.dtype,
                                         device=kv.device)
        self.scratch_scales = torch.empty(L, 2, capacity * block_size, H, dtype=scales.dtype, device=kv.device)
        self.replays = 0
        self.graphs = None
        if capture:
            from o3edge.engine.cuda_graph import capture_graphs

            self.graphs = capture_graphs([0, 1], self._run, "router demotion", error_mode="thread_local")

    @torch.inference_mode()
    def _run(self, parity: int) -> tuple:
        """The device's part of a replay from host buffer `parity` (captured, or run as it is)."""
        n, bs = self.capacity, self.bs
        self.ids.copy_(self.host[parity], non_blocking=True)
        count, src, dst = self.ids[:1], self.ids[1:1 + n], self.ids[1 + n:]
        _launch_quantize(self.kv, src, self.rot, self.scratch_codes, self.scratch_scales, n, count, bs, self.mode)
        L, _, _, H, cd = self.codes.shape
        row, srow = bs * H * cd, bs * H
        _place_blocks_kernel[(n, L * 2)](
            self.scratch_codes, self.scratch_scales, dst, count, self.codes, self.scales, self.codes.stride(1),
            self.scales.stride(1), n, ROW=row, SROW=srow, CHUNK=min(4096, triton.next_power_of_2(row)),
            SCHUNK=min(1024, triton.next_power_of_2(srow)), num_warps=4)
        return ()

    def move(self, moves: np.ndarray) -> None:
        """Quantize full-precision blocks moves[:, 0] into compressed blocks moves[:, 1] (int64 [n, 2])."""
        for lo in range(0, len(moves), self.capacity):
            chunk = moves[lo:lo + self.capacity]
            parity, k = self.replays % 2, len(chunk)
            self.replays += 1
            if self.read[parity] is not None:
                self.read[parity].synchronize()
            host = self.host[parity].numpy()
            host[0] = k
            host[1:1 + k] = chunk[:, 0]
            host[1 + self.capacity:1 + self.capacity + k] = chunk[:, 1]
            if self.graphs is not None:
                self.graphs[parity][0].replay()
            else:
                self._run(parity)
            if self.stream_index is not None:
                self.read[parity] = torch.cuda.Event()
                self.read[parity].record(torch.cuda.current_stream(self.stream_index))
