"""The token router: salient tokens keep full-precision KV, sealed blocks of the rest are compressed.

Saliency, training-free (SnapKV's observation window, ZipCache's normalisation): every attention
probability an observed query gives a cached token is added to the token's mass, and every observed
query that could see the token adds one to its count; saliency = mass / count, so early tokens, seen
by more queries, are not favoured for that alone. The observed queries are the last `obs_window`
tokens of a prompt (in the step that ends it) and, during decode, the token of every
`refresh_steps`-th router step, the step that routes again. Routing runs when a prompt ends and at
every `refresh_steps`-th step after. The refresh steps are the same for every decoding sequence (a
count of the router's steps, not of each sequence's), so that with router_cuda_graphs a batch takes
its observing graph once every `refresh_steps` steps (router_graph.py), not in whichever step one of
its sequences happens to be due. With threshold 0 (every sealed
block outside the sinks and the recent window is demoted: uniform compression) nothing is observed.

Routing: the smallest set of tokens covering `threshold` of the total saliency is salient. A sealed
block (all its tokens computed) that holds no salient token, no attention sink (the first
`sink_tokens`) and no token of the recent window (the last `recent_tokens`) is demoted: its K/V are
quantized (engine/kv_quant.py) into the compressed pool and attention reads them from there. Keys
are cached after RoPE, so a block's place in either pool does not change what it means. A demoted
block stays demoted while it lives; precision is a property of the block, so every sequence sharing
it through the prefix cache reads the same compressed copy, and its hash does not change. A block
another sequence also holds is not demoted (one sequence's saliency does not decide for the other).
A prompt's routing decides in its step; its demotions are carried out when the engine marks the step's
tokens computed (after the blocks sealed are named, so a named block's full-precision copy can be
offered to the cold tier first). A decode refresh's routing reads its saliency one step later, and its
demotions are carried out in the step after that (make_due), on every path alike: the graph path
queues the steps behind the refresh step over the block tables as they are, and carries the demotions
out before it queues the next step (router_graph.py).

Memory: the compressed pool lives in the full-precision pool's own bytes. A full-precision block can
host `per_host` compressed blocks (codes only: INT8 2 and INT4 4 per bf16 block, twice that per
float32 block); their float16 scales sit in a small table beside the pool, counted in the same
budget (`full_blocks_in_budget`). Demoting a block moves it: its codes go into a free compressed
slot (or, when none is free, into the block's own bytes, which then host it and `per_host - 1` free
slots), its table entry, hash and cache entry move to the compressed block id, and its
full-precision block goes back to the free list (engine/router_blocks.py keeps these books). Block
ids from `num_full_blocks` up are compressed: id `num_full_blocks + c` is compressed block c, at
compressed slots [c * block_size, (c + 1) * block_size) of `codes`/`scales`, inside host block
c // per_host.

Attention over both pools: each sequence's keys are split into its full-precision positions and its
compressed ones; each part gives a partial result and its log-sum-exp, and the two are merged. On
CUDA a decode step's compressed part runs in kernels/quant_attention.py; on a CPU whose o3edge kernels
build (cpu_ext.py), a step's decoding queries run both parts in one C++ call a layer with one softmax each
(cpu_router.cpp, native_decode; a refresh step's observing queries stay on torch's operations); everything
else in torch.
With router_cuda_graphs, decode steps run both pools in one kernel inside the CUDA-graph step
instead (router_graph.py); a refresh step's observation is that kernel's side output.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from o3edge.engine.kernels import cuda_index
from o3edge.engine.kv_quant import bytes_per_vector, code_dim, hadamard, quantize, unpack_int4

ROUTER_MODES = ("off", "int8", "int4")
NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # a prompt's attention


@dataclass(frozen=True)
class RouterConfig:
    mode: str = "int8"  # int8 | int4
    threshold: float = 0.85  # share of saliency the kept tokens cover
    sink_tokens: int = 4  # the first tokens: always full precision
    recent_tokens: int = 128  # the last tokens: always full precision
    refresh_steps: int = 32  # decode steps between routing passes
    obs_window: int = 32  # prompt queries observed at prefill
    select: str = "tokens"  # tokens | blocks: what covers the threshold (covering_blocks)
    # a refresh's demotions are carried out over this many steps, a share a step (KVRouter.make_due); a
    # measurement switch, O3EDGE_ROUTER_DEMOTION_STEPS=N: on the H200 spreading them over 4 or 8 steps was
    # slower than all in one step (each share pays the quantization's fixed host cost; docs/benchmarks.md)
    demotion_steps: int = field(default_factory=lambda: int(os.environ.get("O3EDGE_ROUTER_DEMOTION_STEPS", "1")))


def on_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on device, copied from pinned memory without waiting for the work queued there (a
    copy from pageable memory waits for the stream: on the graph path, for the step just launched)."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def salient_rows(rows: list[torch.Tensor], threshold: float) -> torch.Tensor:
    """Bool [len(rows), longest] (False past a row's end): for each row of saliency, the smallest set of
    its positions covering `threshold` of its total (ties broken by position, so the choice is
    deterministic). All rows at once, on their device: one sort for every sequence a step routes."""
    n = max(r.numel() for r in rows)
    sal = rows[0].new_zeros(len(rows), n)
    for i, r in enumerate(rows):
        sal[i, :r.numel()] = r
    return salient(sal, threshold)


def salient(sal: torch.Tensor, threshold: float) -> torch.Tensor:
    """salient_rows over rows already padded with zeros into one [rows, n] tensor."""
    n = sal.shape[1]
    if threshold <= 0:
        return torch.zeros(sal.shape, dtype=torch.bool, device=sal.device)
    vals, order = torch.sort(sal, dim=1, descending=True, stable=True)  # padding (0) sorts after a row's own
    covered = torch.cumsum(vals, 1)
    total = covered[:, -1:]
    count = (covered < threshold * total).sum(1, keepdim=True) + 1  # the first prefix reaching the threshold
    ranks = torch.arange(n, device=sal.device)[None, :]
    pick = (ranks < count) & (total > 0)
    return torch.zeros_like(pick).scatter_(1, order, pick)


def holding_blocks(rows: list[torch.Tensor], threshold: float, block_size: int) -> list[list[bool]]:
    """For each row of saliency (a sequence's positions 0 .. ctx-1), whether each of its sealed blocks
    holds a salient token: one copy to the host for every row."""
    holds = sealed_any(salient_rows(rows, threshold), block_size).tolist()
    return [h[:r.numel() // block_size] for h, r in zip(holds, rows)]


def sealed_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [rows, n] by whole block: [rows, n // block_size, block_size] (a partial last block left out)."""
    sealed = x.shape[1] // block_size
    return x[:, :sealed * block_size].reshape(x.shape[0], sealed, block_size)


def sealed_any(keep: torch.Tensor, block_size: int) -> torch.Tensor:
    """Bool [rows, sealed blocks], on keep's device: whether each whole block of keep [rows, n] holds a True."""
    return sealed_blocks(keep, block_size).any(2)


def pinned_blocks(ctx: int, block_size: int, cfg: RouterConfig) -> np.ndarray:
    """Bool [ctx // block_size]: the sealed blocks that stay full precision whatever their saliency, those
    holding an attention sink or a token of the recent window."""
    return pinned_rows(np.array([ctx]), ctx // block_size, block_size, cfg)[0]


def pinned_rows(ctxs: np.ndarray, width: int, block_size: int, cfg: RouterConfig) -> np.ndarray:
    """pinned_blocks for sequences of contexts ctxs [R] at once: bool [R, width] (a row's blocks past its
    sealed ones are not pinned)."""
    first, ends = unpinned_bounds(ctxs, block_size, cfg)
    i = np.arange(width)
    return (i < first)[None, :] | (i[None, :] >= ends[:, None])


def unpinned_bounds(ctxs, block_size: int, cfg: RouterConfig) -> tuple[int, np.ndarray | torch.Tensor]:
    """(first, ends [R]): the table indices of the blocks that hold neither an attention sink nor a token of the recent
    window, first <= i < ends[r], for sequences of contexts ctxs [R] (a block i holds a sink when i * block_size <
    sink_tokens, and reaches the window when (i + 1) * block_size > ctx - recent_tokens). ctxs: a NumPy array, or an
    integer tensor (plan_mask's, on the device: torch's // of integers floors, as NumPy's)."""
    return -(-cfg.sink_tokens // block_size), (ctxs - cfg.recent_tokens) // block_size


def covering_blocks(mass: np.ndarray, total: float, ctx: int, block_size: int, cfg: RouterConfig,
                    demoted) -> np.ndarray:
    """router_select = "blocks": which sealed blocks stay full precision, given each sealed block's saliency
    (mass, the sum over its tokens) and the sequence's total. What stays full precision anyway (the sink
    and recent-window blocks, the unsealed tail) counts first; then the blocks not yet demoted, most
    salient first, until the full-precision blocks hold `threshold` of the total (or none are left). The
    same guarantee as the token rule (salient: the full-precision tokens hold at least `threshold` of the
    saliency), without keeping a whole block for one token. Bool [ctx // block_size]."""
    n = ctx // block_size
    mass = np.asarray(mass[:n], dtype=np.float64)
    forced = pinned_blocks(ctx, block_size, cfg)
    dem = np.asarray(demoted[:n], dtype=bool)
    keep = forced.copy()
    need = cfg.threshold * total - mass[forced & ~dem].sum() - (total - mass.sum())  # the tail's share counts
    if need > 0:
        cand = np.flatnonzero(~forced & ~dem)
        order = cand[np.argsort(-mass[cand], kind="stable")]  # ties: the earlier block first
        k = int(np.searchsorted(np.cumsum(mass[order]), need)) + 1  # the shortest prefix reaching need
        keep[order[:k]] = True
    return keep


def blocks_to_demote(holds: list[bool], ctx: int, block_size: int, cfg: RouterConfig,
                     demoted: list[bool]) -> list[int]:
    """Indices (in the sequence's block table) of sealed blocks to demote now: those that hold no salient
    token (holds[i], from holding_blocks), no attention sink and no token of the recent window, and are
    not demoted already (`demoted[i]`)."""
    n = ctx // block_size
    ok = ~np.asarray(demoted[:n], dtype=bool) & ~np.asarray(holds[:n], dtype=bool)
    ok &= ~pinned_blocks(ctx, block_size, cfg)
    return np.flatnonzero(ok).tolist()


class SaliencyBooks:
    """Observed attention mass and observer counts of every sequence the router follows: one row each
    of two [rows, max_len] float64 tensors on the pool's device, so that a refresh step adds a whole
    batch's observations, and routing reads its saliency, in a few tensor operations (a loop over the
    sequences took ~6 ms of each refresh step at 4K x 16 on the H200). Rows are reused; the table
    doubles when every row is taken."""

    def __init__(self, max_len: int, device, rows: int = 8):
        self.max_len, self.device = max_len, device
        self.generation = -1  # tables made so far, less one: a CUDA graph that reads them is made again
        self._tables(rows)
        self.rows: dict[int, int] = {}  # seq_id -> row
        self.free = list(range(rows - 1, -1, -1))

    def _tables(self, rows: int) -> None:
        self.mass = torch.zeros(rows, self.max_len, dtype=torch.float64, device=self.device)
        self.count = torch.zeros_like(self.mass)
        self.generation += 1

    @torch.inference_mode()  # the table may have been made in a step's inference mode
    def _grow(self) -> None:
        """Double the tables, every row keeping its books."""
        n, mass, count = self.mass.shape[0], self.mass, self.count
        self._tables(2 * n)
        self.mass[:n], self.count[:n] = mass, count
        self.free = list(range(2 * n - 1, n - 1, -1)) + self.free

    def reserve(self, rows: int) -> None:
        """Tables of at least `rows` rows now (a graph that reads them is captured once, not after growth)."""
        while self.mass.shape[0] < rows:
            self._grow()

    def row(self, seq_id: int) -> int:
        """seq_id's row, taken (zeroed) when it has none."""
        r = self.rows.get(seq_id)
        if r is None:
            if not self.free:
                self._grow()
            r = self.rows[seq_id] = self.free.pop()
        return r

    @torch.inference_mode()  # the table may have been made or grown in a step's inference mode
    def release(self, seq_id: int) -> None:
        r = self.rows.pop(seq_id, None)
        if r is not None:
            self.mass[r].zero_()
            self.count[r].zero_()
            self.free.append(r)

    def saliency(self, rows: list[int], ctxs: list[int]) -> torch.Tensor:
        """[len(rows), max(ctxs)] saliency = mass / observers of each row's positions below its ctx (0 past it)."""
        index, ends = on_device(torch.tensor([rows, ctxs]), self.device)
        return self.saliency_of(index, ends, max(ctxs))

    def saliency_of(self, index: torch.Tensor, ends: torch.Tensor, width: int) -> torch.Tensor:
        """saliency for rows `index` and contexts `ends` already on the device, over `width` positions
        (no copy, no sync: a CUDA graph can hold it)."""
        sal = self.mass[index, :width] / self.count[index, :width].clamp_min(1.0)
        past = torch.arange(width, device=self.device)[None, :] >= ends[:, None]
        return sal.masked_fill_(past, 0.0)


@dataclass
class _SeqStep:
    """One sequence's part of a router step."""

    rows: slice  # its query rows in the step's flat [T] tokens
    start: int  # position of its first query
    q_pos: torch.Tensor  # [n] positions of its queries
    full_slots: torch.Tensor  # [Sf] cache slots of its full-precision keys (new ones included)
    full_pos: torch.Tensor  # [Sf] their positions
    comp_slots: torch.Tensor  # [Sc] cache slots of its compressed keys (all before its queries)
    comp_pos: torch.Tensor  # [Sc]
    observe: int  # observe the last `observe` queries (0: none)
    row: int  # its row of the saliency books


class RouterStep:
    """What attention needs in one router-on step; built by KVRouter.begin_step, used by every layer."""

    def __init__(self, router: "KVRouter", parts: list[_SeqStep]):
        self.router, self.parts = router, parts
        # decoding queries that no refresh observes, on o3edge's CPU kernels (native_decode): all in one call a
        # layer, their slots concatenated once a step
        native, self.others = [], []
        for p in parts:
            (native if router.native and p.rows.stop - p.rows.start == 1 and not p.observe else self.others).append(p)
        self.native_rows = torch.tensor([p.rows.start for p in native]) if native else None
        if native:
            self.full_slots, self.full_offsets = _concatenated([p.full_slots for p in native])
            self.comp_slots, self.comp_offsets = _concatenated([p.comp_slots for p in native])

    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: [T, H, hd] -> [T, H, hd] over both pools."""
        out = torch.empty_like(q)
        if self.native_rows is not None:
            out[self.native_rows] = self.router.attend_native(layer, q[self.native_rows], k_cache, v_cache, self)
        for part in self.others:
            out[part.rows] = self.router.attend_seq(layer, q[part.rows], k_cache, v_cache, part).to(q.dtype)
        return out


def _concatenated(slots: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences' slot lists as one tensor and the offsets [len + 1] where each begins (int64)."""
    offsets = torch.zeros(len(slots) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor([s.numel() for s in slots]).cumsum(0)
    return torch.cat(slots), offsets


def per_host(mode: str, head_dim: int, elem: int) -> int:
    """Compressed blocks one full-precision block's bytes hold (codes only): elem * head_dim / code_dim."""
    return head_dim * elem // code_dim(mode, head_dim)


def scale_bytes_per_block(num_layers: int, kv_heads: int, block_size: int) -> int:
    """Bytes of one compressed block's float16 scales (K and V, every layer)."""
    return num_layers * 2 * block_size * kv_heads * 2


def full_blocks_in_budget(num_blocks: int, block_bytes: int, mode: str, num_layers: int, kv_heads: int,
                          head_dim: int, block_size: int, elem: int) -> int:
    """Full-precision blocks that fit a budget of num_blocks blocks once every block carries the scale
    table of the compressed blocks it can host (3-6% of the bytes)."""
    scales = per_host(mode, head_dim, elem) * scale_bytes_per_block(num_layers, kv_heads, block_size)
    return max(2, num_blocks * block_bytes // (block_bytes + scales))


class KVRouter:
    """The compressed pool's views and scale table, the per-sequence saliency, the routing policy.

    Books on which block is where are kept by engine/router_blocks.py; this class holds tensors."""

    def __init__(self, cfg: RouterConfig, kv_cache: torch.Tensor, num_full_blocks: int, block_size: int,
                 full_bytes_per_token: int, max_len: int | None = None):
        L, _, _, kv_heads, head_dim = kv_cache.shape
        self.cfg, self.block_size, self.device = cfg, block_size, kv_cache.device
        self.stream_index = cuda_index(self.device)  # an event's stream, looked up by index
        self.num_layers, self.kv_heads, self.head_dim = L, kv_heads, head_dim
        self.num_full_blocks = num_full_blocks
        self.per_host = per_host(cfg.mode, head_dim, kv_cache.element_size())
        self.kv_cache = kv_cache
        cd = code_dim(cfg.mode, head_dim)
        ctype = torch.int8 if cfg.mode == "int8" else torch.uint8
        # the pool's bytes seen as codes: compressed slot s of layer l, K/V t at codes[l, t, s]
        self.codes = kv_cache.view(ctype).view(L, 2, -1, kv_heads, cd)
        comp_slots = num_full_blocks * self.per_host * block_size
        self.scales = torch.zeros(L, 2, comp_slots, kv_heads, dtype=torch.float16, device=self.device)
        self.rotation = hadamard(head_dim, device=self.device) if cfg.mode == "int4" else None
        # positions a sequence may reach (default: as many as the pools could hold)
        self.books = SaliencyBooks(max_len or num_full_blocks * self.per_host * block_size, self.device)
        self.step_no = 0  # router steps so far: decode refreshes happen at the same steps for every sequence
        # seq_id -> (table index, block id) to demote: `plans` when this step's end carries them out,
        # `pending` when they were planned in this step (a refresh's: due from the next step)
        self.plans: dict[int, list[tuple[int, int]]] = {}
        self.pending: dict[int, list[tuple[int, int]]] = {}
        # (seq_id, table index, block id): a refresh's due demotions not yet handed to `plans`, `share` of
        # them a step (make_due), at most once a step (`released`: the step_no that last handed some over)
        self.due: list[tuple[int, int, int]] = []
        self.share, self.released = 0, -1
        self.prepared = None  # a graph step's routing started on the device (prepare_routing, or
        # router_graph.py's route graphs): ([(seq_id, context)], holds on the host, event or None, the observing
        # step's rows and their entry_rows or None: _plan's `observed`, with which the holds are plan_mask's
        # demotions rather than the blocks holding a salient token)
        self.deferred = None  # a refresh's routing, planned at the next step's end: (routed, holds, done, observed)
        self.moves: list[tuple[int, int]] = []  # (full-precision block, compressed block) to quantize (move)
        # moves quantized by one Triton kernel (kernels/kv_quantize.py) rather than torch operations: on CUDA
        # (O3EDGE_ROUTER_MOVE_KERNEL=0: torch's, to measure against), and on the graph path under Triton's
        # interpreter (router_graph.py turns it on)
        self.move_kernel = self.device.type == "cuda" and os.environ.get("O3EDGE_ROUTER_MOVE_KERNEL") != "0"
        self.stage = None  # the kernel's ids go to the device through it (kv_quantize.PinnedStage), on CUDA
        # moves by one CUDA graph replay (kv_quantize.MoveGraph), made at warm_up where the kernel runs on CUDA
        # (O3EDGE_ROUTER_MOVE_GRAPH=0: the kernel launched each flush, to measure against). On the H200's host a
        # flush of 170 demotions took 1.13 ms of host time that way and 0.45 ms by the graph, a demoting step
        # 1.81 -> 1.44 ms (docs/results/gpu-2026-12-05/call1/)
        self.move_graph = None
        # a step's CPU decoding queries over both pools in one C++ call a layer (cpu_router.cpp) where that C++
        # reads the cache (native_decode; O3EDGE_ROUTER_NATIVE=0: torch operations, to measure against)
        self.native = native_decode(kv_cache)
        self.full_bytes_per_token = full_bytes_per_token
        self.comp_bytes_per_token = L * 2 * kv_heads * bytes_per_vector(cfg.mode, head_dim)
        self.host_bytes = block_size * full_bytes_per_token + self.per_host * scale_bytes_per_block(
            L, kv_heads, block_size)
        self.warm_up()

    def warm_up(self) -> None:
        """Run the routing's device operations once, at the lengths a sequence can reach, so that no step
        pays for their first use. On CUDA torch sorts rows of up to 4,096 in one kernel and longer ones by
        a segmented sort whose kernels load at their first call: on the H200 (llama-1b, 16 sequences
        decoding past 4,096 tokens), the first refresh step there took 27-34 ms against ~3 for the next
        ones (tools/bench_router.py --gpu, docs/results/gpu-2026-12-02c/router/). The demotions' kernel is
        compiled here too (quantizing block 0 into a scratch), not at the first demotion."""
        if self.device.type != "cuda":
            return
        if self.move_kernel:
            from o3edge.engine.kernels.kv_quantize import MoveGraph, moves_a_replay, quantize_blocks

            quantize_blocks(self.kv_cache, torch.zeros(1, dtype=torch.long, device=self.device), self.block_size,
                            self.cfg.mode, self.rotation)
            if os.environ.get("O3EDGE_ROUTER_MOVE_GRAPH") != "0":
                n = moves_a_replay(self.num_layers, self.block_size, self.kv_heads, self.head_dim, self.cfg.mode)
                self.move_graph = MoveGraph(self.kv_cache, self.codes, self.scales, self.block_size, self.cfg.mode,
                                            self.rotation, n, capture=True)
        if not self.observing or self.cfg.select != "tokens":
            return
        for n in sorted({min(self.books.max_len, 4096), self.books.max_len}):
            sal = torch.zeros(2, n, dtype=self.books.mass.dtype, device=self.device)
            sealed_any(salient(sal, self.cfg.threshold), self.block_size)

    def is_compressed(self, block_id: int) -> bool:
        return block_id >= self.num_full_blocks

    # ---- blocks (called by router_blocks.RouterBlocks) ---------------------------------------
    def move(self, pairs: list[tuple[int, int]]) -> None:
        """Queue demotions' data: for each (block_id, comp), full-precision block block_id's K/V, quantized,
        into compressed block comp. flush_moves carries out every move queued in one quantization; it runs
        before a step's kernels read the pools and before a freed block is handed out again
        (router_blocks.py)."""
        self.moves += pairs

    def flush_moves(self) -> None:
        """Carry out the queued moves: every source block gathered (a copy) before any is written, so a
        block whose own bytes host its codes is read first. (Demoting one block at a time, a quantization
        each, made the router's refresh steps on a trained model take up to 42 ms with INT8 and 108 ms
        with INT4 on the H200: tools/bench_router.py --gpu --shape model, docs/benchmarks.md, ninth round.)
        Called before every graph step and every block handed out, it returns at once when nothing is
        queued, before entering inference mode (whose entry and exit cost more than the check)."""
        if self.moves:
            self._quantize_moves()

    @torch.inference_mode()
    def _quantize_moves(self) -> None:
        bs = self.block_size
        if self.move_graph is not None:
            moves, self.moves = self._moves_array(), []
            self.move_graph.move(moves)
            return
        if self.move_kernel:
            from o3edge.engine.kernels.kv_quantize import PinnedStage, move_blocks

            if self.stage is None and self.device.type == "cuda":
                self.stage = PinnedStage(self.device)
            moves, self.moves = self._moves_array(), []
            move_blocks(self.kv_cache, self.codes, self.scales, moves, bs, self.cfg.mode, self.rotation, self.stage)
            return
        blocks = torch.tensor(self.moves, dtype=torch.long)
        src, dst = on_device((blocks[:, :, None] * bs + torch.arange(bs)).transpose(0, 1).reshape(2, -1), self.device)
        self.moves = []
        # ~4 MB of layers at a time, each chunk's sources gathered before its codes are written (a layer's
        # codes live in its own bytes): with the whole pool at once, ~45 MB temporaries, fresh pages each,
        # made a CPU flush of 170 blocks (the built-in long model, 16 x 3,840 tokens) take 69-80 ms against
        # 36-40 in chunks (tools/bench_demotions.py --device cpu, float32 and bfloat16; docs/benchmarks.md)
        L, layer_bytes = self.num_layers, 2 * len(src) * self.kv_heads * self.head_dim * 4  # in float32
        step = max(1, (4 << 20) // layer_bytes)
        for l0 in range(0, L, step):
            layers = slice(l0, min(L, l0 + step))
            codes, scales = quantize(self.kv_cache[layers].index_select(2, src), self.cfg.mode, self.rotation)
            self.codes[layers].index_copy_(2, dst, codes)
            self.scales[layers].index_copy_(2, dst, scales)

    def _moves_array(self) -> np.ndarray:
        """The queued moves as int64 [n, 2], from one flat iteration of their pairs: np.array of the list of
        tuples took 15.0-15.2 us for a refresh's 176 on the CPU machine, this 8.1-8.3 (tools/bench_router_plan.py):
        host time of the demoting step where a flush takes the kernel or its graph."""
        pairs = itertools.chain.from_iterable(self.moves)
        return np.fromiter(pairs, dtype=np.int64, count=2 * len(self.moves)).reshape(-1, 2)

    def take_plan(self, seq_id: int) -> list[tuple[int, int]]:
        return self.plans.pop(seq_id, [])

    def forget(self, seq_id: int) -> None:
        self.books.release(seq_id)
        self.plans.pop(seq_id, None)
        self.pending.pop(seq_id, None)
        if self.due:
            self.due = [d for d in self.due if d[0] != seq_id]

    # ---- steps -----------------------------------------------------------------------------
    def begin_step(self, batch) -> RouterStep:
        """The per-sequence key split and observation plan of a step over batch [(seq, n)]. Every index the
        step's attention reads goes to the device in one copy (it was five copies a sequence)."""
        self.flush_moves()
        bs, nf, host, plans = self.block_size, self.num_full_blocks, [], []
        for seq, n in batch:
            start = seq.num_computed_tokens
            ctx = start + n
            pos = np.arange(ctx)
            ids = np.asarray(seq.block_table[:-(-ctx // bs)], dtype=np.int64)[pos // bs]
            comp = ids >= nf
            slots = np.where(comp, ids - nf, ids) * bs + pos % bs  # full pool slot or compressed slot
            host += [pos[start:], slots[~comp], pos[~comp], slots[comp], pos[comp]]
            if seq.num_output_tokens > 0:  # decode: the query of the step that routes
                observe = int(n == 1 and self.observing_now())
            else:  # the last queries of the prompt, in the step that ends it
                observe = min(n, self.cfg.obs_window) if ctx == len(seq) else 0
            plans.append((start, n, observe, self.books.row(seq.seq_id)))
        flat = torch.from_numpy(np.concatenate(host)).to(self.device)
        views = iter(flat.split([len(h) for h in host]))
        parts, row = [], 0
        for start, n, observe, book in plans:
            parts.append(_SeqStep(slice(row, row + n), start, *(next(views) for _ in range(5)), observe, book))
            row += n
        return RouterStep(self, parts)

    def needs_eager(self, batch) -> bool:
        """Whether a step over batch must run eager (router_graph.py): a prompt's step, or a sequence
        whose books have not started."""
        rows = self.books.rows  # a plain loop: this runs before every step
        for seq, n in batch:
            if n != 1 or seq.seq_id not in rows or len(seq.token_ids) == seq.num_prompt_tokens:
                return True
        return False

    @property
    def observing(self) -> bool:
        """Whether routing needs saliency (threshold 0 demotes every eligible block without it)."""
        return self.cfg.threshold > 0

    def observing_now(self, ahead: int = 0) -> bool:
        """Whether this step's decoding sequences observe (a refresh step, with saliency needed); with
        ahead, the step that many after this one."""
        return self.observing and self._due(ahead)

    def _due(self, ahead: int = 0) -> bool:
        """Whether the current step (ahead: the one that many after it) is a decode refresh step
        (observe, then route)."""
        return (self.step_no + 1 + ahead) % self.cfg.refresh_steps == 0

    def may_queue_next(self) -> bool:
        """Whether the graph path may queue the next step behind this one: not while demotions planned a step
        ago wait to become due (the next step must read the block tables a due share changes;
        router_graph.py makes them due and carries the share out first where it can)."""
        return not self.pending

    def end_step(self, batch, decoding: bool = False, counted: bool = True) -> None:
        """Route the sequences whose prompt just ended, and the decoding ones due for a refresh. A prompt's
        routing is planned now and carried out at this step's end (RouterBlocks.mark_computed: an eager
        step, nothing queued behind it). A refresh's saliency is read one step later, on every path: at
        the next step's end, when the graph path's reading of it (prepare_routing, queued behind the step
        launched after the refresh step) is done, so that no step waits for it; its demotions are then
        due from the step after that (make_due). decoding: batch is a graph step's (every sequence decoding,
        its books started). counted=False: batch is the prompt rows of a step whose decoding rows took the
        graph step, whose end_step counts the step (runner._run_router_split): only the prompts that end are
        routed, now."""
        quiet = not (self.pending or self.due or self._due()) and self.prepared is None and self.deferred is None
        if decoding and counted and quiet:  # a graph step between refreshes, nothing planned or due
            self.step_no += 1  # all that the rest would do
            return
        if not counted:
            routed = self._routed(batch)
            if routed:
                self._plan(routed, self._held(routed).cpu(), None, self.plans)
            return
        routed = self._routed(batch, decoding)
        prepared, self.prepared = self.prepared, None
        self.make_due()
        self.step_no += 1
        deferred, self.deferred = self.deferred, None
        if deferred is not None:
            routed_then, holds, done, observed = deferred
            self._plan(routed_then, holds, done, self.pending, observed)
        if not routed:
            return
        if prepared is not None and prepared[0] == [(seq.seq_id, ctx) for seq, ctx, _ in routed] \
                and (decoding or prepared[3] is None):  # (a route graph's demotions: a graph step's alone)
            _, holds, done, observed = prepared
        else:
            holds, done, observed = self._held(routed).cpu(), None, None
        if decoding:  # a graph refresh step: every routed sequence decodes, its holds read at the next step's end
            # (which rows were prompts, as a tensor indexing the holds: end_step 16-17 -> 3 us on the CPU machine,
            # tools/bench_router_plan.py)
            self.deferred = (routed, holds, done, observed)
            return
        prompt = [seq.num_output_tokens == 0 for seq, _, _ in routed]
        if any(prompt):  # an eager step (holds are on the host)
            if done is not None:
                done.synchronize()
                done = None
            self._plan([r for r, p in zip(routed, prompt) if p], holds[torch.tensor(prompt)], None, self.plans)
        if not all(prompt):  # a graph step's holds may still be on their way: indexed only on the host path
            later = [not p for p in prompt]
            self.deferred = ([r for r, p in zip(routed, prompt) if not p],
                             holds if not any(prompt) else holds[torch.tensor(later)], done, None)

    def _plan(self, routed, holds: torch.Tensor, done, books: dict, observed=None) -> None:
        """Plan the demotions of routed [(seq, context, book row)] from holds (_held's rows, on the host
        once `done` is), into books (seq_id -> [(table index, block id)]); sequences that ended or were
        preempted since are passed over. observed: the observing graph step's rows, one a routed sequence
        (router_graph.py), with their entry_rows; holds is then plan_mask's rows, the demotions themselves
        (_plan_observed)."""
        if done is not None:
            done.synchronize()
        bs, nf, rows = self.block_size, self.num_full_blocks, self.books.rows
        live = [(r, seq, ctx) for r, (seq, ctx, _) in enumerate(routed)
                if seq.seq_id in rows and len(seq.block_table) >= ctx // bs]
        if not live:
            return
        held = holds.numpy()
        if observed is not None and self.cfg.select == "tokens":
            return self._plan_observed(live, held, observed, books)
        if self.cfg.select == "blocks":  # held: the sealed blocks' saliency, then the total (_held)
            for r, seq, ctx in live:
                table = seq.block_table[:ctx // bs]
                demoted = np.asarray(table) >= nf
                keep = covering_blocks(held[r, :-1], held[r, -1], ctx, bs, self.cfg, demoted)
                plan = blocks_to_demote(keep, ctx, bs, self.cfg, demoted)
                if plan:
                    books[seq.seq_id] = [(i, table[i]) for i in plan]
            return
        # every routed sequence at once (a loop of blocks_to_demote took ~13 us a sequence on the CPU
        # machine, 16 of them a refresh; scratch-free: tables padded with full-precision id 0, masked)
        ctxs = np.array([ctx for _, _, ctx in live])
        ns = ctxs // bs
        width = int(ns.max())
        tables = np.zeros((len(live), width), dtype=np.int64)
        for i, (_, seq, _) in enumerate(live):
            tables[i, :ns[i]] = seq.block_table[:ns[i]]
        ok = (np.arange(width)[None, :] < ns[:, None]) & (tables < nf)  # sealed, not yet demoted
        ok &= ~held[[r for r, _, _ in live], :width] & ~pinned_rows(ctxs, width, bs, self.cfg)
        at, cols = np.nonzero(ok)  # row-major: each row's blocks in table order
        pairs = list(zip(cols.tolist(), tables[at, cols].tolist()))
        ends = np.cumsum(ok.sum(1)).tolist()
        for i, (_, seq, _) in enumerate(live):
            if ends[i] > (start := ends[i - 1] if i else 0):
                books[seq.seq_id] = pairs[start:ends[i]]

    def _plan_observed(self, live, mask: np.ndarray, observed, books: dict) -> None:
        """_plan's token routing from the observing step's rows (observed: (rows, their entry_rows)), whose
        demotions the device has found already (mask: plan_mask's rows, made in the refresh's graph): each row's
        True entries, in table order, with the block ids the step read. The same plans in the same order as _plan's
        from the tables (the full-precision blocks that are sealed, pinned neither as sinks nor in the recent
        window, and hold no salient token); the plans of a sequence whose entries were replaced since (a demotion
        due from an earlier refresh, with router_refresh_steps of 1 or 2) are kept to its entries still full
        precision. (Split into the pools and masked on the host before, a refresh's rows, their observation and
        the plan took 75-76 us on the CPU machine; 36-37 now, tools/bench_router_plan.py.)"""
        rows, entries = observed
        at, index = np.nonzero(mask)  # row-major: each row's demotions in table order
        pairs = list(zip(index.tolist(), entries[at, index].tolist()))
        stops = np.cumsum(np.bincount(at, minlength=len(rows))).tolist()
        for r, seq, ctx in live:
            start, stop = stops[r - 1] if r else 0, stops[r]
            if stop > start:
                plan, sealed = pairs[start:stop], ctx // self.block_size
                if plan[-1][0] >= sealed:  # (the observation's context is the routed one: end_step)
                    plan = [(i, block_id) for i, block_id in plan if i < sealed]
                if seq.table_edits != rows[r][2]:
                    table = seq.block_table
                    plan = [(i, block_id) for i, block_id in plan if table[i] == block_id]
                if plan:
                    books[seq.seq_id] = plan

    def make_due(self) -> None:
        """The demotions planned a step ago (a refresh's) become due, and this step's share of those due
        goes to `plans`, which the block books carry out next (RouterBlocks.carry_out, at the end of this
        step or, on the graph path, before the next step is queued: router_graph.py, which calls this
        earlier in the same step; a step hands over one share, however often it calls). With
        `demotion_steps` above 1 a refresh's demotions are spread over that many steps, a sequence's
        together, every path alike (by default all go in one step). In one step with nothing due before, each
        sequence's plan goes to `plans` whole, the same lists in the same order: 176 demotions 18.1-18.4 -> 0.8
        us on the CPU machine (tools/bench_router_plan.py --root of the commit before)."""
        if self.pending and not self.due and self.cfg.demotion_steps <= 1 and self.released != self.step_no:
            self.released, plans = self.step_no, self.plans
            for seq_id, plan in self.pending.items():
                if seq_id in plans:
                    plans[seq_id] += plan
                else:
                    plans[seq_id] = plan
            self.pending = {}
            return
        if self.pending:
            for seq_id, plan in self.pending.items():
                self.due += [(seq_id, i, block_id) for i, block_id in plan]
            self.pending = {}
            self.share = -(-len(self.due) // max(1, self.cfg.demotion_steps))
        if not self.due or self.released == self.step_no:
            return
        self.released = self.step_no
        share, self.due = self.due[:self.share], self.due[self.share:]
        for seq_id, i, block_id in share:
            self.plans.setdefault(seq_id, []).append((i, block_id))

    def _routed(self, batch, decoding: bool = False) -> list:
        """(seq, context, book row) of the sequences this step routes; their books start when their prompt
        ends, observed or not. decoding: every sequence of batch decodes one token and has its books (a
        graph step's batch, needs_eager false): all are routed at a refresh step, none at another."""
        due, routed, rows = self._due(), [], self.books.rows
        if decoding:
            return [(seq, seq.num_computed_tokens + 1, rows[seq.seq_id]) for seq, _ in batch] if due else []
        for seq, n in batch:
            if not due and n == 1 and seq.seq_id in rows and seq.num_output_tokens > 0:
                continue  # a decoding sequence between refreshes (most steps): nothing to route
            ctx = seq.num_computed_tokens + n
            if ctx < len(seq):
                continue  # a prompt chunk that does not end the prompt
            row = self.books.row(seq.seq_id)
            if seq.num_output_tokens == 0 or due:
                routed.append((seq, ctx, row))
        return routed

    def prepare_routing(self, batch) -> None:
        """Start the saliency reading of the routing end_step will do for this step (a graph step's, after
        its observation's books): on CUDA its result comes back to pinned memory behind an event, so that
        end_step waits for this step's work alone, not for a step queued after it."""
        routed = self._routed(batch, decoding=True)
        if not routed:
            return
        held, done = self._held(routed), None
        if self.device.type == "cuda":
            held = torch.empty(held.shape, dtype=held.dtype, pin_memory=True).copy_(held, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.stream_index))
        self.prepared = ([(seq.seq_id, ctx) for seq, ctx, _ in routed], held, done, None)

    def _held(self, routed) -> torch.Tensor:
        """Bool [routed, sealed blocks] on the device: whether each sealed block of each routed sequence
        holds a salient token; with router_select = "blocks", each sealed block's saliency and then the
        sequence's total instead ([routed, sealed blocks + 1], for covering_blocks)."""
        ctxs = [ctx for _, ctx, _ in routed]
        sal = self.books.saliency([row for _, _, row in routed], ctxs)
        if self.cfg.select == "blocks":
            return torch.cat([sealed_blocks(sal, self.block_size).sum(2), sal.sum(1, keepdim=True)], 1)
        return sealed_any(salient(sal, self.cfg.threshold), self.block_size)

    # ---- attention -------------------------------------------------------------------------
    def attend_seq(self, layer: int, q: torch.Tensor, k_cache, v_cache, part: _SeqStep) -> torch.Tensor:
        """One sequence's queries q [n, H, hd] over its full-precision and compressed keys -> [n, H, hd]."""
        n, H, hd = q.shape
        qf = q.float()
        scale = hd ** -0.5
        kf = k_cache.index_select(0, part.full_slots).float()
        vf = v_cache.index_select(0, part.full_slots).float()
        if n > 1 and not part.comp_slots.numel():  # a prompt's chunk over full-precision keys alone
            return self._prompt_attention(layer, qf, kf, vf, part, scale)
        s_full = _scores(qf, kf, self.kv_heads) * scale  # [H, n, Sf]
        if n > 1:  # one decoding query sees every key (its own included): nothing to mask
            s_full = _causal(s_full, part.full_pos, part.q_pos)
        lse_f = torch.logsumexp(s_full, -1)  # every query sees itself: finite
        o = _weighted(torch.exp(s_full - lse_f[..., None]), vf, self.kv_heads)  # [H, n, hd]
        s_comp = None
        if part.comp_slots.numel():
            if q.is_cuda and n == 1:
                from o3edge.engine.kernels.quant_attention import quant_attention_partial

                blocks = (part.comp_slots[::self.block_size] // self.block_size).to(torch.int32)
                o_c, lse_c = quant_attention_partial(self._rotate(qf[0][None]), blocks[None], self.codes[layer],
                                                     self.scales[layer], self.cfg.mode, self.block_size)
                o_c, lse_c = self._rotate(o_c).transpose(0, 1), lse_c.transpose(0, 1)  # [H, 1, hd], [H, 1]
            else:
                kq, ks = self._codes(layer, 0, part.comp_slots)
                vq, vs = self._codes(layer, 1, part.comp_slots)
                s_comp = _scores(self._rotate(qf), kq, self.kv_heads, ks) * scale  # [H, n, Sc]
                lse_c = torch.logsumexp(s_comp, -1)
                o_c = self._rotate(_weighted(torch.exp(s_comp - lse_c[..., None]), vq, self.kv_heads, vs))
            lse = torch.logaddexp(lse_f, lse_c)
            o = o * torch.exp(lse_f - lse)[..., None] + o_c * torch.exp(lse_c - lse)[..., None]
        else:
            lse = lse_f
        if part.observe:
            self._observe(layer, part, s_full, s_comp, lse, qf, scale)
        return o.transpose(0, 1)  # [n, H, hd]

    def attend_native(self, layer: int, q: torch.Tensor, k_cache, v_cache, step: RouterStep) -> torch.Tensor:
        """The step's decoding queries that no refresh observes, q [B, H, hd] (one a sequence, in step.native_rows'
        order), over both pools in one call of o3edge's CPU kernel (cpu_router.cpp) -> [B, H, hd] in q's dtype."""
        qf = q.float()
        rot = self.rotation if self.rotation is not None else qf.new_empty(0)
        o = torch.ops.o3edge_cpu.router_decode_attention(
            qf, self._rotate(qf), k_cache.contiguous(), v_cache.contiguous(), step.full_slots, step.full_offsets,
            self.codes[layer, 0], self.codes[layer, 1], self.scales[layer, 0], self.scales[layer, 1], step.comp_slots,
            step.comp_offsets, rot)
        return o.to(q.dtype)

    def _prompt_attention(self, layer: int, qf, kf, vf, part: _SeqStep, scale: float) -> torch.Tensor:
        """attend_seq for a prompt's queries when every key is full precision (no prefix hit on a compressed
        block): torch's fused attention, no [H, n, keys] matrix of scores; only the observed last queries'
        scores are made, for their probabilities. (With the whole matrix made and masked, a CPU prefill of
        two 1,500-token prompts on the built-in long model took 3.6 s against 1.3 with the router off:
        tools/bench_router.py --speed, docs/benchmarks.md.)"""
        n, H, hd = qf.shape
        q, k, v = qf.transpose(0, 1)[None], kf.transpose(0, 1)[None], vf.transpose(0, 1)[None]
        dt = self.kv_cache.dtype
        flash = qf.is_cuda and dt in (torch.float16, torch.bfloat16)
        if flash:  # in the cache's dtype (q, k and v are its values, exactly), for torch's flash attention: in
            # float32 with GQA only its plain path takes it, which makes the [H, n, keys] matrix. Not cuDNN's
            # attention, torch's first choice on the H200: it spent ~40 ms of host time a call on the built-in
            # long model's 3,840-token prompts (tools/profile_router_step.py --prompts)
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
        if part.start == 0 and kf.shape[0] == n:  # the whole prompt in this step: causal, aligned
            with sdpa_kernel(NOT_CUDNN):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        elif flash:  # a later chunk over every key up to it (none compressed): causal from the bottom right
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, kf.shape[0]), scale=scale,
                                               enable_gqa=True)
        else:  # a later chunk: query i sees keys up to its own position
            mask = part.full_pos[None, :] <= part.q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        if part.observe:
            w = part.observe
            s = _causal(_scores(qf[-w:], kf, self.kv_heads) * scale, part.full_pos, part.q_pos[-w:])  # [H, w, Sf]
            self._observe(layer, part, s, None, torch.logsumexp(s, -1), qf[-w:], scale)
        return o[0].transpose(0, 1)  # [n, H, hd]

    def observed_in_graph(self, rows, mass: torch.Tensor) -> None:
        """Add a graph decode step's observation (router_graph.py) to its sequences' books: rows
        [(seq, its block-table entries the step read, its table_edits then)] in step order;
        mass [len(rows), KVH, 2, P] the step's probabilities by KV head (kernels/quant_attention.py
        router_decode_attention: full-precision keys in compacted order, then compressed ones), summed
        over the layers. The same books as `_observe` keeps for the eager step, in one scatter."""
        entries = np.zeros((len(rows), mass.shape[-1] // self.block_size + 3), dtype=np.int64)
        self.entry_rows(rows, entries)
        meta = self.observation_of(on_device(torch.from_numpy(entries), self.device))  # one copy
        self.observe_books(meta, mass)

    def entry_rows(self, rows, out: np.ndarray) -> None:
        """The host part of an observation: rows (an observing graph step's: (seq, its table entries as int32,
        its table_edits)) into out, int64 [len(rows), W + 3]: each row's entries from column 0 (past them, what
        was there), their number, the sequence's book row and the observer's position + 1 (its context). The
        device splits them into the pools (observation_of) and finds the demotions among them (plan_mask)."""
        width, book_row = out.shape[1] - 3, self.books.row
        for r, (_, t, _) in enumerate(rows):
            out[r, :len(t)] = t
        if rows:
            out[:len(rows), width:] = [(len(t), book_row(seq.seq_id), seq.num_computed_tokens + 1)
                                       for seq, t, _ in rows]

    def observation_of(self, entries: torch.Tensor) -> torch.Tensor:
        """entry_rows' rows on the device as observe_books and held_observed read them: int64 [n, 2 W + 4], each
        row's table indices of its full-precision blocks (from column 0, in table order) and of its compressed
        ones (from column W), its number of keys in each pool (the full-precision ones up to the observer's, its
        own included), its book row and its context. A row of zeros observes nothing and routes nothing. Static
        shapes, no sync: a CUDA graph can hold it (router_graph.py's route graphs)."""
        n, W, bs, dev = entries.shape[0], entries.shape[1] - 3, self.block_size, entries.device
        t, count, book_rows, ends = entries[:, :W], entries[:, W], entries[:, W + 1], entries[:, W + 2]
        col = torch.arange(W, device=dev)
        valid = col < count[:, None]
        comp = valid & (t >= self.num_full_blocks)
        pools = torch.stack([valid ^ comp, comp], 1)  # [n, 2, W]: full-precision entries, compressed ones
        ranks = pools.cumsum(2)  # each entry's place in its pool, from 1; the last: the pool's count
        dump = 2 * W + 4  # the column where the other pool's entries (and none) go
        first = torch.arange(2, device=dev)[:, None] * W - 1  # each pool's first column, less one
        where = torch.where(pools, ranks + first, dump).view(n, 2 * W)
        meta = torch.zeros(n, 2 * W + 5, dtype=torch.long, device=dev)
        meta.scatter_(1, where, col.repeat(n, 2))
        comp_keys = ranks[:, 1, -1] * bs
        meta[:, 2 * W:dump] = torch.stack([ends - comp_keys, comp_keys, book_rows, ends], 1)
        return meta[:, :dump]

    def plan_mask(self, entries: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """The demotions a refresh plans, on the device: bool [n, W] over entry_rows' rows, True at each
        full-precision entry that is sealed, neither pinned as a sink nor in the recent window (unpinned_bounds,
        for the row's context), and holds no salient token (held: held_observed's rows). _plan_observed reads
        it back. Static shapes, no sync."""
        W, bs = entries.shape[1] - 3, self.block_size
        t, count, ends = entries[:, :W], entries[:, W], entries[:, W + 2]
        col = torch.arange(W, device=entries.device)
        first, stop = unpinned_bounds(ends, bs, self.cfg)
        stop = torch.minimum(stop, ends // bs)  # sealed only
        ok = (col < count[:, None]) & (t < self.num_full_blocks) & (col >= first) & (col < stop[:, None])
        return ok & ~held[:, col.clamp(max=held.shape[1] - 1)]

    def observe_books(self, meta: torch.Tensor, mass: torch.Tensor) -> None:
        """The device part of observed_in_graph, meta (observation_of's) on the device: the keys' places
        are made there, then one scatter a table, no sync (a CUDA graph can hold it: router_graph.py)."""
        bs, L, P, dev, n = self.block_size, self.books.max_len, mass.shape[-1], self.device, meta.shape[0]
        W = P // bs  # blocks a row of the step may have
        tables, num_keys = meta[:, :2 * W].reshape(n, 2, W), meta[:, 2 * W:2 * W + 2]
        book_rows, ends = meta[:, -2], meta[:, -1]
        keys = (tables[..., None] * bs + torch.arange(bs, device=dev)).view(n, 2, P)  # each key's position
        lane = torch.arange(P, device=dev)
        valid = lane < num_keys[..., None]  # full keys: the new token's too
        # a lane past a pool's keys adds 0 at its own place in the row (lane % L), not at one shared element: the
        # ~4,400 unused lanes a row of the built-in long model had at 16 x 3,840 (73% compressed) all adding into
        # one element made this scatter's atomics queue there, 0.13 ms of a refresh's device time on the H100
        # (tools/profile_router_step.py --trace, docs/results/gpu-2026-12-05d/call2/)
        dest = book_rows[:, None, None] * L + torch.where(valid, keys, lane % L)
        # mass [n, KVH, 2, P] summed over the KV heads lines up with dest [n, 2, P]: one scatter, no sync
        add = mass.sum(1).double().masked_fill_(~valid, 0.0)
        self.books.mass.view(-1).index_add_(0, dest.view(-1), add.view(-1))  # every row at once
        seen = torch.arange(L, device=dev)[None, :] < ends[:, None]  # one observer sees up to its own position
        self.books.count.index_add_(0, book_rows, seen.double())

    def route_in_kernels(self, entries: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        """observation_of, observe_books, held_observed and plan_mask at once (kernels/route.py): entry_rows'
        rows on the device and the observing step's mass [n, KVH, 2, P] in, the books added to, plan_mask's
        rows out. Static shapes, no sync: a CUDA graph can hold it."""
        from o3edge.engine.kernels.route import route

        first, _ = unpinned_bounds(0, self.block_size, self.cfg)
        return route(entries, mass, self.books.mass, self.books.count, self.num_full_blocks, self.block_size,
                     self.cfg.threshold, first, self.cfg.recent_tokens)

    def held_observed(self, meta: torch.Tensor) -> torch.Tensor:
        """_held for the rows of an observation's meta on the device (observation_of: book row, context),
        over every position a sequence may reach: bool [rows, max_len // block_size], False past a row's
        sealed blocks, all False for a row of zeros. Static shapes, no sync: a CUDA graph can hold it."""
        sal = self.books.saliency_of(meta[:, -2], meta[:, -1], self.books.max_len)
        return sealed_any(salient(sal, self.cfg.threshold), self.block_size)

    def _codes(self, layer: int, t: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed keys (t = 0) or values (t = 1) at slots: their codes as float32 [S, KVH, hd] (int4:
        in the rotated basis) and their scales [S, KVH] (float32), which multiply the dots and the
        probabilities rather than every code: a pass over every compressed vector fewer each step (the CPU
        router's INT4 decode went from 0.71x to 0.82x of full precision's speed: tools/bench_router.py
        --speed, docs/benchmarks.md)."""
        c = self.codes[layer, t].index_select(0, slots)
        return (c.float() if self.cfg.mode == "int8" else unpack_int4(c),
                self.scales[layer, t].index_select(0, slots).float())

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Into the INT4 pool's rotated basis, and back: the Hadamard matrix is its own inverse."""
        return x if self.rotation is None else x @ self.rotation

    def _observe(self, layer, part: _SeqStep, s_full, s_comp, lse, qf, scale) -> None:
        """Add the last `observe` queries' attention probabilities (mean over heads) to the mass."""
        w = part.observe
        lse_w = lse[:, -w:, None]
        mass = self.books.mass[part.row]
        p_full = torch.exp(s_full[:, -w:] - lse_w).mean(0).sum(0)  # [Sf]
        mass.index_add_(0, part.full_pos, p_full.double())
        if part.comp_slots.numel():
            if s_comp is None:  # the kernel gave no scores: recompute them for the one query
                kq, ks = self._codes(layer, 0, part.comp_slots)  # the keys alone
                s_comp = _scores(self._rotate(qf), kq, self.kv_heads, ks) * scale
            p_comp = torch.exp(s_comp[:, -w:] - lse_w).mean(0).sum(0)
            mass.index_add_(0, part.comp_pos, p_comp.double())
        if layer:
            return  # the observers are counted once a step
        end = part.start + part.q_pos.numel()  # host-side: no copy from the device
        q_pos = torch.arange(end - w, end)
        ctx = end
        seen = (torch.arange(ctx)[None, :] <= q_pos[:, None]).sum(0).double()
        self.books.count[part.row, :ctx] += on_device(seen, self.device)

    # ---- figures ---------------------------------------------------------------------------
    def stats(self, blocks) -> dict:
        """Memory the blocks holding K/V (in use or cached) really take, per token they hold, and the
        share of those tokens in each pool. A host block counts whole (its free compressed slots too),
        with its scale table; blocks: the engine's RouterBlocks."""
        full, comp = blocks.held_blocks()
        hosts = blocks.num_host_blocks
        tokens = (full + comp) * self.block_size
        held = full * self.block_size * self.full_bytes_per_token + hosts * self.host_bytes
        share = full / (full + comp) if full + comp else 1.0
        return {"kv_router": self.cfg.mode,
                "kv_bytes_per_token": round(held / tokens, 1) if tokens else float(self.full_bytes_per_token),
                "kv_full_precision_bytes_per_token": self.full_bytes_per_token,
                "kv_tokens_full_share": round(share, 4), "kv_tokens_compressed_share": round(1 - share, 4),
                "kv_blocks_compressed": comp, "kv_host_blocks": hosts,
                "kv_blocks_demoted_total": blocks.num_demoted}


def native_decode(kv_cache: torch.Tensor) -> bool:
    """Whether decoding queries' attention over both pools runs o3edge's C++ (cpu_router.cpp, one call a layer for
    a step's sequences): a cache that C++ reads (cpu_ext.reads_cache), unless O3EDGE_ROUTER_NATIVE=0."""
    if os.environ.get("O3EDGE_ROUTER_NATIVE") == "0":
        return False
    from o3edge.engine import cpu_ext

    return cpu_ext.reads_cache(kv_cache)


def _causal(s: torch.Tensor, key_pos: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Scores s [H, n, S] with each query's later keys (key_pos [S] past its q_pos [n]) at -inf."""
    return s.masked_fill(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))


def _scores(q: torch.Tensor, k: torch.Tensor, kv_heads: int,
            key_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, hd], k [S, KVH, hd] (float32) -> [H, n, S] dot products, GQA groups of H / KVH heads; with
    key_scales [S, KVH], k holds codes and each dot is multiplied by its key's scale."""
    n, H, hd = q.shape
    G = H // kv_heads
    qg = q.view(n, kv_heads, G, hd).permute(1, 2, 0, 3).reshape(kv_heads, G * n, hd)
    s = torch.bmm(qg, k.permute(1, 2, 0))  # [KVH, G*n, S]
    if key_scales is not None:
        s = s * key_scales.t()[:, None, :]
    return s.view(H, n, k.shape[0])


def _weighted(p: torch.Tensor, v: torch.Tensor, kv_heads: int,
              value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """p [H, n, S], v [S, KVH, hd] -> [H, n, hd]; with value_scales [S, KVH], v holds codes and each
    probability is multiplied by its value's scale."""
    H, n, S = p.shape
    G = H // kv_heads
    pg = p.reshape(kv_heads, G * n, S)
    if value_scales is not None:
        pg = pg * value_scales.t()[:, None, :]
    out = torch.bmm(pg, v.permute(1, 0, 2))  # [KVH, G*n, hd]
    return out.view(H, n, v.shape[-1])
