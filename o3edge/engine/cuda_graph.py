"""Decode steps with static shapes, replayed from CUDA graphs.

Eager decode of a small model spends most of its time launching kernels, so decode steps (one new
token per sequence) run on preallocated buffers, padded to a bucket of batch sizes and key lengths,
and on CUDA each (batch, length) bucket is captured once at start-up and replayed. Padding rows write
their K/V into a scratch slot that no sequence owns. With `capture=False` the same static path runs
eagerly, which lets the CPU tests check the padding logic.
"""

from __future__ import annotations

import logging

import torch

from o3edge.engine.model import StepBatch

log = logging.getLogger(__name__)


def block_tables(seqs, num_rows: int, num_blocks: int) -> torch.Tensor:
    """[num_rows, num_blocks] block ids of each sequence's first blocks (padding rows and tails: 0)."""
    tables = torch.zeros(num_rows, num_blocks, dtype=torch.long)
    for b, seq in enumerate(seqs):
        row = seq.block_table[:num_blocks]
        tables[b, :len(row)] = torch.tensor(row, dtype=torch.long)
    return tables


def key_slots(tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[rows, blocks] block ids -> [rows, blocks * block_size] cache slot of every key position."""
    rows, blocks = tables.shape
    return (tables[:, :, None] * block_size + torch.arange(block_size)).view(rows, blocks * block_size)


def buckets(limit: int, start: int) -> list[int]:
    """start, 2*start, ... up to and including limit."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, capture: bool):
        self.runner, self.capture = runner, capture
        self.block_size = runner.block_size
        max_len = -(-runner.max_model_len // self.block_size) * self.block_size
        self.batch_buckets = buckets(max_batch, 1)
        self.len_buckets = buckets(max_len, max(256, self.block_size))
        B, S, dev = self.batch_buckets[-1], self.len_buckets[-1], runner.device
        self.scratch_slot = runner.scratch_slot
        self.input_ids = torch.zeros(B, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((B,), self.scratch_slot, dtype=torch.long, device=dev)
        self.kv_slots = torch.full((B, S), self.scratch_slot, dtype=torch.long, device=dev)
        self.mask = torch.zeros(B, 1, 1, S, dtype=torch.bool, device=dev)
        self.arange = torch.arange(B, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_steps = 0

    def fits(self, batch) -> bool:
        """Whether a step's batch can take this path: decode only, within the largest buckets."""
        return (all(n == 1 for _, n in batch) and len(batch) <= self.batch_buckets[-1]
                and max(s.num_computed_tokens + 1 for s, _ in batch) <= self.len_buckets[-1])

    def _step_batch(self, B: int, S: int) -> StepBatch:
        return StepBatch(slot_mapping=self.slot_mapping[:B], q_dest=self.arange[:B], kv_slots=self.kv_slots[:B, :S],
                         attn_mask=self.mask[:B, :, :, :S], num_seqs=B, max_q=1, logits_index=self.arange[:B],
                         dense=True)

    def _forward(self, B: int, S: int) -> torch.Tensor:
        r = self.runner
        return r.model(self.input_ids[:B], self.positions[:B], r.cos, r.sin, self._step_batch(B, S), r.kv_cache)

    def capture_all(self) -> None:
        """Capture one graph per (batch, length) bucket, largest first, sharing one memory pool."""
        pool = None
        for B in reversed(self.batch_buckets):
            for S in reversed(self.len_buckets):
                self.mask[:B, :, :, 0] = True  # a valid row for the warm-up
                for _ in range(2):  # warm up on a side stream, as capture requires
                    self._forward(B, S)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(B, S)
                pool = graph.pool()
                self.graphs[(B, S)] = (graph, out)
        torch.cuda.synchronize()
        log.info("captured %d decode graphs (batch %s x length %s)", len(self.graphs), self.batch_buckets,
                 self.len_buckets)

    @torch.inference_mode()
    def run(self, batch) -> torch.Tensor:
        """Logits [len(batch), V] for a decode-only batch."""
        bs, n = self.block_size, len(batch)
        self.num_steps += 1
        B = next(b for b in self.batch_buckets if b >= n)
        ctx = [s.num_computed_tokens + 1 for s, _ in batch]
        S = next(s for s in self.len_buckets if s >= max(ctx))
        ids = torch.tensor([s.token_ids[c - 1] for (s, _), c in zip(batch, ctx)])
        pos = torch.tensor(ctx) - 1
        slots = key_slots(block_tables([s for s, _ in batch], B, S // bs), bs)
        key_pos = torch.arange(S)
        lens = torch.zeros(B, dtype=torch.long)
        lens[:n] = torch.tensor(ctx)
        mask = key_pos[None, :] < lens[:, None]
        mask[n:, 0] = True  # padding rows attend to one scratch key: no NaN, result unused
        slots[n:] = self.scratch_slot
        slot_map = torch.full((B,), self.scratch_slot, dtype=torch.long)
        slot_map[:n] = slots[torch.arange(n), pos]
        self.input_ids[:n].copy_(ids, non_blocking=True)
        self.positions[:n].copy_(pos, non_blocking=True)
        self.slot_mapping[:B].copy_(slot_map, non_blocking=True)
        self.kv_slots[:B, :S].copy_(slots, non_blocking=True)
        self.mask[:B, 0, 0, :S].copy_(mask, non_blocking=True)
        if self.capture:
            graph, out = self.graphs[(B, S)]
            graph.replay()
            return out[:n]
        return self._forward(B, S)[:n]
