"""The token router's decode steps on the CUDA-graph path (cuda_graph.py), off unless asked for.

A router decode step is the plain graph step (decode_step.py) with each layer's attention replaced by
kernels/quant_attention.router_decode_attention: RoPE, the K/V write, and attention over the
sequence's full-precision blocks and its compressed blocks, merged by log-sum-exp, all inside the
captured graph. Its metadata rows are wider: the full-precision block table is compacted (the
compressed blocks left out) and the compressed blocks get a table of their own.

Steps that observe attention for saliency (every `refresh_steps`-th router step, the same for every
sequence; none with threshold 0) replay a second graph per bucket: the same step whose attention
kernels also store each key's scaled scores, and a small kernel turns them into probabilities
(averaged over the heads) once every key split's log-sum-exp is known, adding them into a static mass
buffer layer after layer; once the step is taken, a third graph per bucket (and host buffer) takes the
table entries the step read, splits them into the pools, adds those rows to each sequence's books, reads the
saliency it will route by and finds the blocks to demote, which come back to pinned memory
(_observe_and_route: kernels/route.py's three kernels and a sort, KVRouter.route_in_kernels, or with
O3EDGE_ROUTER_FUSED_ROUTE=0 KVRouter.observation_of, observe_books, held_observed, plan_mask; a step that
lost sequences since it was queued, and router_select = "blocks", do the same by KVRouter.observed_in_graph
and prepare_routing, one operation at a time).
(O3EDGE_ROUTER_OBSERVE_SPLITS=0 observes in one key split instead, each program making its rows'
probabilities in a second pass over its keys: on the H200 its replay took ~3.9 ms against ~2.1 at 4K x
16, docs/benchmarks.md, ninth round. Observing in a second kernel after the bucket's splits, which read
the keys again, was no faster than that: docs/results/gpu-2026-12-01c/; it was removed.) Prompt steps
run eager.

Steps are launched ahead as on the plain graph path (cuda_graph.py: the host's work for step n hides
under the GPU's for step n+1), observing steps and the steps after a refresh included: an observing
step's books are added when it is taken (a dropped one adds nothing), once the step after it is queued,
and the saliency the routing reads is started behind that step and read at its end (router.py), so no
step waits for it. A refresh's demotions are due from the step after that (KVRouter.make_due), and
take effect from the step after the one that carries them out, as on the eager path; on this path they
are carried out before the next step is queued (RouterDecodeGraphs._continues; the eager path does them
at the step's end), so every decode step but the first is queued. Blocks demoted since the last step
get their codes (KVRouter.flush_moves) before a step is launched.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from o3edge.engine.cuda_graph import DecodeGraphs, capture_graphs
from o3edge.engine.decode_step import decode_forward
from o3edge.engine.kernels import INTERPRET
from o3edge.engine.kernels.quant_attention import observe_splits


def router_attention_per_sm(mode: str) -> int:
    """Programs per SM that the two-pool kernel's key splits fill, as a ceiling: as many splits as fit in one
    wave of the programs an SM holds at once: four programs of four warps, its code for sm_90 capped at 104
    registers a thread (quant_attention.register_cap). On the H200 (tools/bench_attention.py --splits,
    docs/results/gpu-2026-12-02k/attention/), llama-1b at 16 x 4,096 (128 programs a split): INT8 39.5 us a
    layer at 4 splits, 48.1 at 3, 53.9 at 5; INT4 50.0 at 4, 64.5 at 3, 52.3 at 8. Before the cap (INT4 at 160
    registers, three an SM; docs/results/gpu-2026-12-02c/attention/): INT8 41.7 at 4 splits, 45.8 at 3;
    INT4 56.9 at 3, 62.6 at 4; the reference model at 16 x 3,840 (2 KV heads, 32 programs a split): INT8
    12.8 at 16 splits, 20.3 at 9, 15.4 at 32; INT4 18.7 at 12, 19.3 at 16, 23.0 at 9.
    O3EDGE_ROUTER_PER_SM=N takes N instead (a measurement switch)."""
    return int(os.environ.get("O3EDGE_ROUTER_PER_SM", "4"))


def fused_route() -> bool:
    """Whether a route graph runs a refresh's routing in kernels/route.py's three kernels and one sort (the
    default) instead of KVRouter's ~70 small operations (observation_of, observe_books, held_observed,
    plan_mask; O3EDGE_ROUTER_FUSED_ROUTE=0, a measurement switch). The same 693 demotions either way on the
    trained model at 16 x 3,840 tokens on an H100; the step after a refresh, which waits for the route graph,
    0.698 -> 0.489 ms (docs/results/gpu-2026-12-05g/call7/) and 0.56-0.58 -> 0.51-0.55 in the next call's two
    rounds (call8/; 0.51-0.52 -> 0.43-0.46 with threshold 0.3)."""
    return os.environ.get("O3EDGE_ROUTER_FUSED_ROUTE", "1") != "0"


class RouterDecodeGraphs(DecodeGraphs):
    """DecodeGraphs for a router-on runner (runner.router is the KVRouter)."""

    def __init__(self, runner, max_batch: int, capture: bool, launch_ahead: bool | None = None):
        super().__init__(runner, max_batch, capture, launch_ahead)
        if runner.device.type != "cuda" and INTERPRET:  # the graph path's tests: demotions by its kernel too
            runner.router.move_kernel = True
        self.sampling = False  # sampled rows: sampled after the graph (graph sampling is the plain path's)
        self.observe_graphs: dict = {}
        self.rows: list | None = None  # an observing step's rows (seq, its table entries as read, its table_edits):
        # what it observes, and what its routing plans from (KVRouter.entry_rows, _plan)
        self.observed: dict[int, list] = {}  # ahead (0: launched now, 1: queued) -> rows of an observing step
        self.mass = None
        self.taken = None  # an observing step taken: (its rows, their probabilities), for _taken
        if runner.router.observing:  # [bucket, KVH, 2, keys]: one observing step's probabilities
            self.mass = torch.zeros(self.batch_buckets[-1], runner.args.num_kv_heads, 2,
                                    self.max_blocks * self.block_size, dtype=torch.float32, device=runner.device)
        # a refresh's books and saliency read in one graph a bucket and host buffer (_route), when the whole
        # observing step is taken; the rows of a step that lost sequences, and router_select = "blocks", go
        # through observed_in_graph and prepare_routing instead
        self.routes = self.mass is not None and runner.router.cfg.select == "tokens"
        self.route_graphs: dict = {}  # (bucket, parity) -> (graph,)
        self.route_generation = None  # the books' generation the route graphs were captured on
        self.num_routes = 0
        if self.routes:
            B, dev, pinned = self.batch_buckets[-1], runner.device, runner.device.type == "cuda"
            width = self.max_blocks + 3  # KVRouter.entry_rows
            self.mass_taken = torch.zeros_like(self.mass)  # a taken observing step's probabilities
            self.obs_host = [torch.zeros(B, width, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
            self.obs = torch.zeros(B, width, dtype=torch.long, device=dev)
            self.demote_host = [torch.zeros(B, self.max_blocks, dtype=torch.bool, pin_memory=pinned)
                                for _ in range(2)]  # the refresh's demotions (KVRouter.plan_mask)

    def attention_per_sm(self) -> tuple[int, bool]:
        return router_attention_per_sm(self.runner.router.cfg.mode), True

    def meta_columns(self) -> int:
        """token, position, slot, full-precision keys before the token, compressed blocks, then the
        compacted full-precision table and the compressed table (max_blocks each)."""
        return 5 + 2 * self.max_blocks

    def fits(self, batch) -> bool:
        """DecodeGraphs.fits and not KVRouter.needs_eager, whose loop over the batch rules out a row of more
        than one token too: the base class's own loop left out (~1 us a step at 16 sequences on the CPU
        machine, py-spy of tools/bench_host_step.py)."""
        return len(batch) <= self.batch_buckets[-1] and not self.runner.router.needs_eager(batch)

    def _continues(self, batch) -> bool:
        """DecodeGraphs._continues, once a refresh's due demotions (this step's share) are carried out: on
        every path they take effect from the next step (this one was queued with the tables before them),
        so they are done here, before that step is queued with the tables they leave, rather than at this
        step's end, which would leave the GPU idle while the host does them and prepares the next step."""
        runner, router = self.runner, self.runner.router
        if (router.pending or router.due) and runner.carry_out is not None:
            router.make_due()
            for seq, _ in batch:
                runner.carry_out(seq)
        return super()._continues(batch) and router.may_queue_next()

    def capture_all(self) -> None:
        super().capture_all()
        if self.mass is not None:
            self.observe_graphs = capture_graphs(self.graph_keys(), functools.partial(self._forward, observe=True),
                                                 "router observing decode", error_mode="thread_local")
        if self.routes:
            self.runner.router.books.reserve(2 * self.batch_buckets[-1])
            self._capture_routes()

    @torch.inference_mode()
    def _capture_routes(self) -> None:
        """(Re)capture the route graphs on the books' current tables, from zeroed host buffers (a capture's
        warm-up runs replay what the buffers hold: zero rows observe and route nothing), once the device
        has read what they held before."""
        torch.cuda.synchronize()
        for buf in self.obs_host:
            buf.zero_()
        self.route_graphs = capture_graphs(self.graph_keys(), self._route, "router routing", error_mode="thread_local")
        self.route_generation = self.runner.router.books.generation

    def _route(self, key: tuple[int, int]) -> tuple:
        """A refresh's device work for bucket B from host buffer `parity`: the observing step's entries in
        (KVRouter.entry_rows), split into the pools (observation_of), the books added to (observe_books), the
        saliency read and routed (held_observed), the demotions found (plan_mask) and out to demote_host[parity]."""
        B, parity = key
        router = self.runner.router
        entries = self.obs[:B].copy_(self.obs_host[parity][:B], non_blocking=True)
        if fused_route():
            demote = router.route_in_kernels(entries, self.mass_taken[:B])
        else:
            meta = router.observation_of(entries)
            router.observe_books(meta, self.mass_taken[:B])
            demote = router.plan_mask(entries, router.held_observed(meta))
        self.demote_host[parity][:B].copy_(demote, non_blocking=True)
        return ()

    def _observe_and_route(self, observed, batch) -> None:
        """The refresh step taken whole (observed: its rows, in batch order; their probabilities in
        mass_taken): its books and the saliency read the routing at this step's end takes (end_step: the
        `prepared` holds), in one graph replay instead of ~40 operations launched one by one (on the H200's
        host they took ~1.8 ms of a refresh step on the built-in long model: docs/benchmarks.md)."""
        router, n = self.runner.router, len(observed)
        B = next(b for b in self.batch_buckets if b >= n)
        if self.capture and router.books.generation != self.route_generation:
            self._capture_routes()  # the books' tables grew: the graphs read the old ones
        parity = self.num_routes % 2  # the holds of the refresh before may still be unread (refresh every step)
        self.num_routes += 1
        entries = self.obs_host[parity].numpy()
        router.entry_rows(observed, entries[:n])
        entries[n:B] = 0
        done = None
        if self.capture:
            self.route_graphs[(B, parity)][0].replay()
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device_index))
        else:
            self._route((B, parity))
        router.prepared = ([(seq.seq_id, seq.num_computed_tokens + 1) for seq, _ in batch],
                           self.demote_host[parity][:n], done, (observed, entries[:n]))

    def _attention(self, layer, qkv, cos, sin, meta, heads, splits, q_norm, k_norm, eps, mass=None):
        from o3edge.engine.kernels.quant_attention import router_decode_attention

        r, kv = self.runner.router, self.runner.kv_cache
        return router_decode_attention(qkv, cos, sin, meta, kv[layer, 0], kv[layer, 1], r.codes[layer],
                                       r.scales[layer], r.rotation, r.cfg.mode, heads, self.block_size, splits,
                                       q_norm, k_norm, eps, mass=mass)

    def _decode(self, B: int, observe: bool = False):
        r = self.runner
        attention, splits = self._attention, self.splits[B]
        if observe:
            mass = self.mass[:B]
            mass.zero_()
            attention = functools.partial(self._attention, mass=mass)
            # the bucket's splits store scores, observed after them; with O3EDGE_ROUTER_OBSERVE_SPLITS=0
            # one split, each program knowing its rows' final log-sum-exp and observing in place
            splits = splits if observe_splits() else 1
        return decode_forward(r.model, self.meta[:B], r.cos, r.sin, r.kv_cache, self.block_size, splits,
                              self.fused, attention=attention, last=self.last)

    def _launch(self, batch, B: int, ahead: int = 0, rows=()):
        self.runner.router.flush_moves()  # blocks demoted since the last step: their codes first
        out = super()._launch(batch, B, ahead, rows)
        self.observed[ahead] = self.rows
        return out

    def _step(self, key: tuple[int, int]):
        if self.rows is None:
            return super()._step(key)
        if self.capture:
            graph, logits, out = self.observe_graphs[key]
            graph.replay()
            return logits, out
        return self._forward(key, observe=True)

    def _ran(self, batch, rows, index) -> None:
        """The step taken: when it observed, its rows (of the sequences still in the batch) and a copy of
        their probabilities, taken before a next step is queued (an observing one would write over them)."""
        self.taken, observed = None, self.observed.pop(0 if rows is None else 1, None)
        self.observed.clear()
        if observed is not None:
            mass = self.mass[:len(observed)]
            if index is None and self.routes:  # the whole step: routed in one graph (_observe_and_route)
                self.mass_taken[:len(observed)].copy_(mass)
                self.taken = (observed, None)
                return
            if index is not None:
                observed, mass = [observed[i] for i in rows], mass.index_select(0, index)
            self.taken = (observed, mass.clone() if index is None else mass)

    def _taken(self, batch) -> None:
        """Once the next step is queued (its launch does not wait for this): the observing step's books,
        then the saliency the routing reads at the next step's end (KVRouter.end_step), started behind it."""
        router, taken, self.taken = self.runner.router, self.taken, None
        if taken is not None and taken[1] is None:
            if router.observing_now():  # a refresh step (observing steps are): its books and routing in one graph
                self._observe_and_route(taken[0], batch)
                return
            taken = (taken[0], self.mass_taken[:len(taken[0])])
        if taken is not None:
            router.observed_in_graph(*taken)
        router.prepare_routing(batch)

    def _split(self, table: list[int], grown: tuple | None = None) -> tuple:
        """Table entries as (the metadata row's two tables: full-precision blocks, then from column max_blocks
        compressed blocks - num_full_blocks; the number of compressed blocks; the entries in an array of
        max_blocks, the first len(table) of them, whose split into table indices an observing step makes).
        Made in Python for every sequence at every step, the router's fill_meta took 0.33 ms a step on the CPU
        machine (16 tables of ~120 blocks; 0.09 ms then: tools/bench_step_meta.py --against c62e0f1), as much
        as a whole graph step of a small model on the H200 (tools/profile_router_step.py --trace); fill_meta
        makes them again only when a sequence's entries changed (a new block, a demotion).

        grown: what this made for the entries before `table`'s (table: only the entries appended since), whose
        row and count go on from there, its entries array written past them in place (a holder of an earlier
        value reads no further than its own entries, which do not change). On the CPU machine a table of ~120
        blocks took ~4.3 us to make whole, and one new block ~1 us this way (timed alone)."""
        nf, mb = self.runner.router.num_full_blocks, self.max_blocks
        if grown is not None:
            row, comp, t = grown
            row, start = row.copy(), len(t)
            num_full = start - comp
            for block_id in table:
                if block_id < nf:
                    row[num_full], num_full = block_id, num_full + 1
                else:
                    row[mb + comp], comp = block_id - nf, comp + 1
            t = t.base[:start + len(table)]  # the max_blocks array it is the start of
            t[start:] = table
            return row, comp, t
        t = np.zeros(mb, dtype=np.int32)[:len(table)]  # room for the blocks the sequence goes on to take
        t[:] = table
        full = t < nf
        f, c = t[full], t[~full] - nf
        row = np.zeros(2 * mb, dtype=np.int32)  # one array to copy into the step's row
        row[:len(f)], row[mb:mb + len(c)] = f, c
        return row, len(c), t

    def fill_meta(self, meta, batch, B: int, ahead: int, parity: int | None = None) -> None:
        """DecodeGraphs.fill_meta with the router's columns (meta_columns). A row's tables come from
        DecodeGraphs.cached; a table that only grew since its last step is extended (_split's grown) rather than
        made again; the rows' first five columns go in by one flat array."""
        bs, mb, n = self.block_size, self.max_blocks, len(batch)
        made = self.rows_made(parity, n)
        self.rows = [] if self.mass is not None and self.runner.router.observing_now(ahead) else None
        heads = []  # each row's first five columns, one row after another
        for b, (seq, _) in enumerate(batch):
            pos, table = seq.num_computed_tokens + ahead, seq.block_table
            k = pos // bs + 1  # the entries the row reads
            value = self.cached(seq, k, self._split, self._split)
            comp, token = value[1], 0 if ahead else seq.token_ids[pos]  # a queued step's tokens: read on the device
            heads += (token, pos, table[k - 1] * bs + pos % bs, pos - comp * bs, comp)
            if made[b] is not value:
                meta[b, 5:5 + 2 * mb], made[b] = value[0], value
            if self.rows is not None:  # the entries as read: split into the pools for all rows at once, later
                self.rows.append((seq, value[2], seq.table_edits))
        meta[:n, :5] = np.array(heads, dtype=np.int32).reshape(n, 5)
        meta[n:B, :5] = (0, 0, self.runner.scratch_slot, 0, 0)  # padding rows: scratch slot, self only
