"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, whatever the context length.

Eager decode of a small model spends most of its time launching kernels, so a decode step (one new
token per sequence) runs the whole model, greedy choice included, as one captured graph over static
buffers. The step's only input is the int32 metadata matrix of `kernels/decode_attention.py` (token,
position, cache slot and block table per row), copied to the device in one transfer; attention reads
the KV cache in place through the block table, so nothing in a graph depends on the context length.
The step itself is decode_step.py's (at batch 1, five kernels a layer of its own plus the attention
splits' merge: 6.2 on `llama-1b`, launched with programmatic dependent launch, kernels/pdl.py). Attention
is split along the key axis into enough programs to fill the GPU when the batch alone does not (the
split sizes follow the context at run time, so the graph does not change). Padding rows (a batch
smaller than its bucket) write into a scratch slot that no sequence owns. Each graph also holds its
step's copies, the metadata in from pinned host memory and the greedy tokens out to it, so that nothing
runs on the stream between two graphs: two graphs a bucket, one per host buffer (a step's buffer can
still be in flight while the next step's is filled).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os

import numpy as np
import torch

from o3edge.engine.decode_step import decode_forward
from o3edge.engine.kernels import cuda_index, num_sms
from o3edge.engine.sampling import counter_sample, counter_settings, sampling_graph
from o3edge.engine.sequence import SamplingParams

log = logging.getLogger(__name__)

MAX_SPLITS = 32


def attention_splits(batch: int, kv_heads: int, num_sms: int, per_sm: int, one_wave: bool = False) -> int:
    """Key-axis splits for a batch bucket: about per_sm programs per SM (at most per_sm with one_wave), one
    split once the batch fills the SMs. Decode attention is bound by memory latency, so more programs keep
    more loads in flight: on the H200, llama-1b at 16 sequences of 4,096 tokens (128 programs a split), a
    layer took 56.9 us at 3 splits (two programs per SM, the rule before), 45.9 at 6 and 40.7 at 12
    (tools/bench_attention.py, docs/results/gpu-2026-12-01c/attn-grid.json)."""
    programs = batch * kv_heads
    if programs >= num_sms:
        return 1
    target = per_sm * num_sms
    return max(1, min(MAX_SPLITS, target // programs if one_wave else -(-target // programs)))


def buckets(limit: int, start: int) -> list[int]:
    """start, 2*start, ... up to and including limit."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def _int32(entries: list[int]) -> np.ndarray:
    return np.asarray(entries, dtype=np.int32)


@contextlib.contextmanager
def _no_collection():
    """Python's cyclic garbage collector off for the block (as it was after)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def capture_graphs(sizes: list, forward, what: str, error_mode: str = "global") -> dict:
    """size -> (graph, *outputs of forward(size)), captured largest first into one shared memory pool.
    error_mode: torch.cuda.graph's capture_error_mode ("thread_local" lets the pinned-memory allocator
    query its events while a graph copies to or from host memory).

    Python's cyclic garbage collector is held off during each capture: a collection there that frees an
    earlier engine's graph (an engine replaced, or dropped in a reference cycle) destroys a graph while
    the stream captures, which CUDA refuses, invalidating the capture and aborting the process (seen on
    the H200 when a tool loaded one engine after another, docs/results/gpu-2026-12-03h/). Torch no longer
    collects before a capture, so it is done here, once."""
    graphs, pool = {}, None
    gc.collect()
    for size in sorted(sizes, reverse=True):
        for _ in range(2):  # warm up (Triton compiles here), as capture requires
            forward(size)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with _no_collection(), torch.cuda.graph(graph, pool=pool, capture_error_mode=error_mode):
            outputs = forward(size)
        pool = graph.pool()
        graphs[size] = (graph, *outputs)
    torch.cuda.synchronize()
    log.info("captured %d %s graphs (%s)", len(graphs), what, sorted(graphs))
    return graphs


class DecodeGraphs:
    """Decode steps on static buffers, replayed from one CUDA graph per batch bucket.

    With launch_ahead (the default when capturing), a greedy step also queues the next step before it
    returns: that step's input tokens are this step's greedy outputs, read on the device by the next
    graph's embedding (kernels/embedding.py: a metadata token -(r + 1) is row r of them), so the GPU
    computes step n+1 while the host streams step n's tokens and schedules. If the engine's next batch
    is that same batch one token on, or the same less sequences that finished or were preempted, the
    queued step is taken (the rows of those that left are passed over); if not (a request joined,
    sampling), its results are dropped. That is safe: a row wrote only the K/V of its sequence's next
    position, into a slot of a block the sequence held (given one step early when the position starts
    a block) that no cached prefix shares, since only full blocks are named; a block freed since is
    written again before it is read, by steps that run after the queued one on the same stream.

    The graphs' own copies (the metadata in, the greedy tokens out, the input tokens taken inside the
    graph) replaced three copies and a cast kernel that ran between two graphs on the stream, overlapping
    no kernel: on the H200 (tinyllama fp16, whole generations, both orders in one call) they made decode
    0.1-0.3% faster at batch 1 and 1-2% at batch 8 and 32, fp16 and INT4-FFN alike
    (docs/results/gpu-2026-12-03c/).
    """

    ATTENTION_PER_SM = 8  # attention programs per SM that the key splits aim for (attention_splits)

    def __init__(self, runner, max_batch: int, capture: bool, launch_ahead: bool | None = None):
        self.runner, self.capture = runner, capture
        self.launch_ahead = capture if launch_ahead is None else launch_ahead
        self.fused = runner.device.type == "cuda"  # skinny matmuls at batch 1 (slow under Triton's interpreter)
        self.block_size = runner.block_size
        self.max_blocks = -(-runner.max_model_len // self.block_size)
        self.batch_buckets = buckets(max_batch, 1)
        B, dev = self.batch_buckets[-1], runner.device
        sms = num_sms(str(dev))
        # off CUDA the kernels run under Triton's interpreter (the CPU tests), one program after another:
        # one program per "SM" still splits the keys at batch 1 (2 splits with 2 KV heads), at an eighth of
        # the programs
        per_sm, one_wave = self.attention_per_sm() if dev.type == "cuda" else (1, False)
        self.splits = {b: attention_splits(b, runner.args.num_kv_heads, sms, per_sm, one_wave)
                       for b in self.batch_buckets}
        pinned = dev.type == "cuda"
        width = self.meta_columns()
        self.meta = torch.zeros(B, width, dtype=torch.int32, device=dev)
        # two host buffers: one can still be in flight to the device while the other is filled
        self.meta_host = [torch.zeros(B, width, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        for m in self.meta_host:
            m[:, 2] = runner.scratch_slot
        self.meta.copy_(self.meta_host[0])
        self.num_fills = 0
        # rows of a queued step kept when sequences left the batch (_select); two host buffers as for meta
        self.rows_host = [torch.zeros(B, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self.rows_dev = torch.zeros(B, dtype=torch.long, device=dev)
        self.num_selects = 0
        self.graphs: dict = {}  # (bucket, parity) -> (graph, logits, tokens)
        # the last step's greedy tokens on the device, and a host buffer for them and an event a parity
        self.last = torch.zeros(B, dtype=torch.long, device=dev)
        self.tokens_hosts = [torch.zeros(B, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self.copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self.device_index = cuda_index(dev)  # the stream a step's event is recorded on, by index (cuda_index)
        self.ahead: list[tuple[int, int, int]] | None = None  # (seq_id, position, token) of the queued step
        self.memo: dict[int, tuple] = {}  # seq_id -> (its table, entries, edits, what fill_meta made: cached)
        # for each host buffer, what `cached` made that each row's block-table columns hold now: a row whose
        # sequence's table is unchanged since that buffer's last step is not written again (fill_meta)
        self.row_made: list[list] = [[None] * B for _ in range(2)]
        self.num_steps = self.num_ahead_taken = 0
        # sampled rows drawn inside the graph (sampling.counter_sample), steps with any such row replaying a
        # graph of their own a bucket and parity (three: with the top-p cut of rows with top-p alone, with that
        # and a selection of the k-th largest for rows of a top-k above TOP_K_CAP, and with neither), launched
        # ahead like greedy ones (O3EDGE_GRAPH_SAMPLING=0: sampled after the graph, never launched ahead). Their
        # settings come in beside the metadata, from two host buffers.
        self.sampling = os.environ.get("O3EDGE_GRAPH_SAMPLING", "1") != "0" and (
            dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")  # Triton kernels (uncaptured on a CPU)
        self.vocab = runner.args.vocab_size
        self.greedy_row = torch.tensor(counter_settings([SamplingParams()], self.vocab)[0])  # padding rows
        width = len(self.greedy_row)
        self.samp = torch.zeros(B, width, dtype=torch.float32, device=dev)
        self.samp_host = [torch.zeros(B, width, dtype=torch.float32, pin_memory=pinned) for _ in range(2)]
        for h in self.samp_host:  # greedy rows until filled (a capture's warm-up reads them)
            h[:] = self.greedy_row
        self.seeds = torch.zeros(B, dtype=torch.long, device=dev)
        self.seeds_host = [torch.zeros(B, dtype=torch.long, pin_memory=pinned) for _ in range(2)]

    def attention_per_sm(self) -> tuple[int, bool]:
        """(attention programs per SM the key splits aim for, whether that is a ceiling: attention_splits)."""
        return self.ATTENTION_PER_SM, False

    def meta_columns(self) -> int:
        """Columns of a step's metadata row: token, position, slot, then the block table."""
        return 3 + self.max_blocks

    def fits(self, batch) -> bool:
        """Whether a step's batch can take this path: decode only, within the largest batch bucket."""
        return all(n == 1 for _, n in batch) and len(batch) <= self.batch_buckets[-1]

    def _forward(self, key: tuple[int, int], observe: bool = False):
        """The step of bucket B with its copies: the metadata from host buffer `parity`, the input tokens of
        a launched-ahead step from `last` on the device, the greedy tokens back into host buffer `parity`.
        (observe: the token router's observing step, router_graph.py.)"""
        B, parity, sampled = key[0], key[1], len(key) > 2
        self.meta[:B].copy_(self.meta_host[parity][:B], non_blocking=True)
        if sampled:  # (B, parity, 1, 2 or 3): the rows' sampling settings and seeds too
            self.samp[:B].copy_(self.samp_host[parity][:B], non_blocking=True)
            self.seeds[:B].copy_(self.seeds_host[parity][:B], non_blocking=True)
        logits, tokens = self._decode(B, observe)
        if sampled:  # the counter: each row's position (its draw is the same on every path: runner.py)
            tokens = counter_sample(logits, tokens, self.samp[:B], self.seeds[:B], self.meta[:B, 1],
                                    nucleus=key[2] >= 2, wide=key[2] == 3)
            self.last[:B].copy_(tokens)  # a launched-ahead step's input tokens
        self.tokens_hosts[parity][:B].copy_(tokens, non_blocking=True)
        return logits, tokens

    def _decode(self, B: int, observe: bool = False):
        """The model's decode step over the metadata of bucket B in place: (logits, greedy tokens)."""
        r = self.runner
        return decode_forward(r.model, self.meta[:B], r.cos, r.sin, r.kv_cache, self.block_size, self.splits[B],
                              self.fused, last=self.last)

    def graph_keys(self) -> list[tuple[int, int]]:
        """(bucket, parity): a graph per batch bucket and host buffer; with graph sampling also (bucket,
        parity, 1), the step that samples, (bucket, parity, 2), the one that cuts top-p rows too, and
        (bucket, parity, 3), the one that also selects a large top-k's k-th largest (sampling_graph)."""
        keys = [(b, parity) for b in self.batch_buckets for parity in (0, 1)]
        return keys + [(*k, s) for s in (1, 2, 3) for k in keys] if self.sampling else keys

    def capture_all(self) -> None:
        """Capture the graphs (thread-local capture errors: the pinned-memory allocator queries its events
        while a graph copies to or from host memory)."""
        self.graphs = capture_graphs(self.graph_keys(), self._forward, "decode", error_mode="thread_local")
        log.info("decode attention splits by batch: %s", self.splits)

    def _launch(self, batch, B: int, ahead: int = 0, rows: list[int] = ()):
        """Queue a step for batch, each sequence `ahead` positions past its computed tokens; with ahead, row
        b's input token is row rows[b] of the step queued before (its `last`). Returns (logits, parity):
        the step's greedy tokens reach tokens_hosts[parity] behind copied[parity]."""
        parity = self.num_fills % 2
        meta = self.meta_host[parity].numpy()
        self.num_fills += 1
        self.fill_meta(meta, batch, B, ahead, parity)
        if ahead:
            meta[:len(batch), 0] = -1 - np.asarray(rows, dtype=np.int32)
        key = (B, parity)
        if self.sampling and not all(seq.params.greedy for seq, _ in batch):
            key = (B, parity, self._fill_sampling(parity, batch, B))
        logits, _ = self._step(key)
        if self.copied[parity] is not None:
            self.copied[parity].record(torch.cuda.current_stream(self.device_index))
        return logits, parity

    def _step(self, key: tuple[int, int]):
        """Run the step of graph key (bucket, parity): (logits, greedy tokens)."""
        if self.capture:
            graph, logits, out = self.graphs[key]
            graph.replay()
            return logits, out
        return self._forward(key)

    def cached(self, seq, n: int, make, grow=None):
        """make(seq.block_table[:n]), made again only when those entries may have changed since the sequence's
        last step (a table changes once a block, not once a token): turning a list of block ids into an array
        row every step was most of the host's metadata work (tools/profile_router_step.py --trace). The table
        is the same when it is the same list (allocate and free_seq put a new one in place), n is the same,
        and no entry was replaced in place since (seq.table_edits: the router's demotions; appends only add
        entries past n). The entries themselves were compared before (a copy of the list and an equality test
        each row each step): with fill_meta's rows kept, the host's step is 9% lighter
        (docs/results/cpu-host-step-2026-12-05/). With grow, a table that only grew since (more entries read,
        none replaced) is grow(the entries appended, what was made for those before) instead of made whole."""
        table, hit = seq.block_table, self.memo.get(seq.seq_id)
        if hit is not None and hit[0] is table and hit[2] == seq.table_edits:
            if hit[1] == n:
                return hit[3]
            if grow is not None and hit[1] < n:
                value = grow(table[hit[1]:n], hit[3])
                self.memo[seq.seq_id] = (table, n, hit[2], value)
                return value
        if len(self.memo) > 4 * self.batch_buckets[-1]:  # sequences that ended: forgotten now and then
            self.memo.clear()
        value = make(table[:n])
        self.memo[seq.seq_id] = (table, n, seq.table_edits, value)
        return value

    def rows_made(self, parity: int | None, n: int) -> list:
        """What the block-table columns of host buffer `parity`'s rows hold (row_made, kept up to date by
        fill_meta); parity None: a buffer of unknown content, every row to be written."""
        return self.row_made[parity] if parity is not None else [None] * n

    def fill_meta(self, meta, batch, B: int, ahead: int, parity: int | None = None) -> None:
        """Rows of a step's host metadata (numpy) for batch, then padding rows up to bucket B. parity: meta is
        host buffer `parity`, whose rows' block tables are written only where they changed (row_made); None:
        every row written. At 16 x 3,840 tokens on the CPU machine, against 894534c (every table's entries
        compared and written each step), alternating (docs/results/cpu-host-step-2026-12-05/): a step's rows
        13.4-14.0 -> 6.4-6.6 us, the router's 15.6-16.8 -> 7.8-8.4 (tools/bench_step_meta.py); the host's whole
        decode step 0.0995-0.104 -> 0.0906-0.0975 ms, router INT8's ordinary steps 0.116-0.145 -> 0.108-0.113
        (tools/bench_host_step.py)."""
        bs, made = self.block_size, self.rows_made(parity, len(batch))
        for b, (seq, _) in enumerate(batch):
            pos = seq.num_computed_tokens + ahead
            table = seq.block_table
            meta[b, 0], meta[b, 1] = (0 if ahead else seq.token_ids[pos]), pos
            meta[b, 2] = table[pos // bs] * bs + pos % bs
            row = self.cached(seq, len(table), _int32)
            if made[b] is not row:
                meta[b, 3:3 + len(table)] = made[b] = row
        meta[len(batch):B, :3] = (0, 0, self.runner.scratch_slot)  # padding rows: scratch slot, self only

    def _fill_sampling(self, parity: int, batch, B: int) -> int:
        """Host buffer `parity`'s sampling settings and seeds for batch (padding rows greedy); the sampling
        graph the step takes (sampling_graph)."""
        n, samp = len(batch), self.samp_host[parity]
        rows = counter_settings([seq.params for seq, _ in batch], self.vocab)
        samp[:n] = torch.tensor(rows)
        samp[n:B] = self.greedy_row
        self.seeds_host[parity][:n] = torch.tensor([self.runner.seed_of(seq) for seq, _ in batch])
        return sampling_graph(rows)

    def _continues(self, batch) -> bool:
        """Whether a step for this batch one token on may be queued: every sequence is greedy (or drawn in the
        graph, with graph sampling), still within the model's length and holds a block for its next position,
        and some sequence goes on past this step (a row of one that ends here is computed and left unused). A
        sequence about to start a block is given it now (runner.reserve_block): sequences that started at
        different times cross block boundaries at different steps, and without it 16 of them in 32-token
        blocks left half the steps unqueued (tools/probe_launch_ahead.py)."""
        bs, limit, reserve = self.block_size, self.runner.max_model_len, self.runner.reserve_block
        for seq, _ in batch:
            nxt = seq.num_computed_tokens + 1
            if (not seq.params.greedy and not self.sampling) or nxt != len(seq) or nxt >= limit:
                return False
            if nxt // bs >= len(seq.block_table) and (reserve is None or not reserve(seq)):
                return False
        return any(seq.params.max_new_tokens - seq.num_output_tokens >= 2 for seq, _ in batch)

    def drop_ahead(self) -> None:
        """Forget a queued step (another path runs this step)."""
        self.ahead = None

    def _is_ahead(self, batch) -> list[int] | None:
        """The queued step's rows for batch's sequences when each is the queued step's sequence one token
        on, in the same order (rows of sequences that left the batch since, finished or preempted, are
        passed over); None when the queued step does not serve this batch."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        rows, i = [], 0
        for seq, _ in batch:
            while i < len(ahead) and ahead[i][0] != seq.seq_id:
                i += 1
            if i == len(ahead):
                return None
            _, pos, tok = ahead[i]
            if seq.num_computed_tokens != pos or seq.token_ids[pos] != tok:
                return None
            rows.append(i)
            i += 1
        return rows

    def _ran(self, batch, rows: list[int] | None, index: torch.Tensor | None) -> None:
        """Hook: the step for batch is on the device (rows: the queued step's rows it took, None when
        launched now; index: those rows on the device when not all of them), the next not yet queued."""

    def _taken(self, batch) -> None:
        """Hook: the step for batch is taken and the next one queued when it could be (work queued here
        runs on the device behind that one)."""

    def _select(self, rows: list[int]) -> torch.Tensor:
        """rows as an index tensor on the device, copied from pinned memory without a sync."""
        host = self.rows_host[self.num_selects % 2]
        self.num_selects += 1
        host[:len(rows)] = torch.tensor(rows, dtype=torch.long)
        return self.rows_dev[:len(rows)].copy_(host[:len(rows)], non_blocking=True)

    @torch.inference_mode()
    def run(self, batch, greedy_only: bool = False) -> tuple[torch.Tensor | None, list[int] | None]:
        """Logits [n, V] float32 (None once a queued step has overwritten them) and, with
        greedy_only, the greedy tokens as a list, for a decode-only batch of n sequences."""
        self.num_steps += 1
        n = len(batch)
        B = next(b for b in self.batch_buckets if b >= n)
        rows, index = self._is_ahead(batch), None
        if rows is None:
            logits, parity = self._launch(batch, B)
            taken = list(range(n))
        else:
            self.num_ahead_taken += 1
            (logits, parity), taken = self._queued, rows
            if rows != list(range(n)):  # sequences left the batch: the rows of those that stay
                index = self._select(rows)
                logits = None if greedy_only else logits.index_select(0, index)
        self._ran(batch, rows, index)
        if not greedy_only:
            self._taken(batch)
            return logits[:n], None
        ahead = self.launch_ahead and self._continues(batch)
        if ahead:  # step n+1 runs while we return; its input tokens are this step's rows `taken`
            self._queued = self._launch(batch, B, ahead=1, rows=taken)
        self._taken(batch)
        if self.copied[parity] is not None:
            self.copied[parity].synchronize()
        out = self.tokens_hosts[parity].tolist()
        picked = [out[r] for r in taken]
        if not ahead:
            return None if logits is None else logits[:n], picked
        self.ahead = [(seq.seq_id, seq.num_computed_tokens + 1, tok) for (seq, _), tok in zip(batch, picked)]
        return None, picked
