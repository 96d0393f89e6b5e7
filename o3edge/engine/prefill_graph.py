"""A fresh prompt's prefill replayed from CUDA graphs, one per token-count bucket.

Eager prefill of a short prompt is launch-bound like eager decode (~25 kernels a layer, each paying
the host's dispatch cost), so a step that prefills one sequence from its first token runs the model
body captured for the smallest bucket of 16, 32, ... tokens that holds the chunk. Padding tokens write
their K/V into the scratch slot and are masked causally like real ones: a real token never sees them.
With the paged prefill kernel (CUDA), attention reads the sequence's keys through its block table, so
the same graphs also serve a chunk after a cached prefix (a prefix-cache or cold-tier hit, a later
chunk of a long prompt): the prefix length is data, not shape. Steps with several sequences or
decodes mixed in still run eagerly.
"""

from __future__ import annotations

import logging

import torch

from o3edge.engine.cuda_graph import buckets, capture_graphs
from o3edge.engine.model import StepBatch

log = logging.getLogger(__name__)

MIN_BUCKET = 16


class PrefillGraphs:
    def __init__(self, runner, max_tokens: int, capture: bool):
        self.runner, self.capture = runner, capture
        limit = min(max_tokens, runner.max_model_len)
        self.token_buckets = buckets(limit, MIN_BUCKET) if limit >= MIN_BUCKET else []
        T, dev = (self.token_buckets or [1])[-1], runner.device
        self.input_ids = torch.zeros(T, dtype=torch.long, device=dev)
        self.positions = torch.arange(T, device=dev)
        self.slots = torch.full((1, T), runner.scratch_slot, dtype=torch.long, device=dev)
        self.last = torch.zeros(1, dtype=torch.long, device=dev)
        self.arange = torch.arange(T, device=dev)
        self.paged = runner.paged_prefill  # the kernel path: (first row, tokens, start) and the block table
        # the masked path's [1, 1, T, T] causal mask (T*T bytes: 64 MB at 8K tokens), only where it is read
        self.mask = None if self.paged else torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None, None]
        self.seqs = torch.zeros(1, 3, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(1, -(-runner.max_model_len // runner.block_size), dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.num_steps = 0

    def fits(self, batch) -> bool:
        """One sequence's chunk within the largest bucket, from its first token (any start when paged)."""
        return (len(batch) == 1 and (self.paged or batch[0][0].num_computed_tokens == 0) and 1 < batch[0][1]
                and bool(self.token_buckets) and batch[0][1] <= self.token_buckets[-1])

    def _forward(self, T: int):
        r = self.runner
        if self.paged:
            step = StepBatch(slot_mapping=self.slots[0, :T], q_dest=None, kv_slots=None, attn_mask=None, num_seqs=1,
                             max_q=T, logits_index=self.last, seqs=self.seqs, tables=self.tables,
                             block_size=r.block_size)
        else:
            step = StepBatch(slot_mapping=self.slots[0, :T], q_dest=self.arange[:T], kv_slots=self.slots[:, :T],
                             attn_mask=self.mask[:, :, :T, :T], num_seqs=1, max_q=T, logits_index=self.last,
                             dense=True)
        logits = r.model(self.input_ids[:T], self.positions[:T], r.cos, r.sin, step, r.kv_cache)  # [1, V]
        return logits, logits.argmax(-1)

    def capture_all(self) -> None:
        """Capture one graph per token bucket."""
        self.graphs = capture_graphs(self.token_buckets, self._forward, "prefill")

    @torch.inference_mode()
    def run(self, batch, kv_ready=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [1, V] float32, greedy token [1]) after prefilling the chunk; kv_ready is called
        once the inputs are queued, before the model's first kernel (restored blocks land there)."""
        seq, n = batch[0]
        self.num_steps += 1
        T = next(t for t in self.token_buckets if t >= n)
        bs, table, start = self.runner.block_size, seq.block_table, seq.num_computed_tokens
        pos = torch.arange(start, start + n)
        slots = torch.full((T,), self.runner.scratch_slot, dtype=torch.long)
        slots[:n] = torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs
        self.input_ids[:n].copy_(torch.tensor(seq.token_ids[start:start + n]), non_blocking=True)
        self.slots[0, :T].copy_(slots, non_blocking=True)
        self.last.fill_(n - 1)
        if self.paged:  # padding rows keep positions past the chunk (clamped): they write only the scratch slot
            limit = self.runner.max_model_len - 1
            self.positions[:T].copy_(torch.arange(start, start + T).clamp_(max=limit), non_blocking=True)
            self.seqs.copy_(torch.tensor([[0, n, start]], dtype=torch.int32), non_blocking=True)
            self.tables[0, :len(table)].copy_(torch.tensor(table, dtype=torch.int32), non_blocking=True)
        if kv_ready is not None:
            kv_ready()
        if self.capture:
            graph, logits, tokens = self.graphs[T]
            graph.replay()
        else:
            logits, tokens = self._forward(T)
        return logits, tokens
