#!/usr/bin/env python3
"""Host time of the token router's refresh bookkeeping, each part timed alone at a refresh of the built-in long
model (16 sequences of 3,840 tokens, 32-token blocks, ~176 demotions): the refresh step's observation rows
(KVRouter.entry_rows; observation_meta in trees that split them on the host) and its end (KVRouter.end_step,
where a graph step's routing is deferred), the step after it's planning (KVRouter._plan: from the block tables,
and from the observing step's rows as a graph refresh plans; its candidates masked on the device where the tree
does that, KVRouter.plan_mask, untimed), the three together as a graph refresh takes them (the rows as fill_meta
makes them, their observation's rows, the plan), and the demoting step's hand-over of the plans
(KVRouter.make_due) and its moves as an array (KVRouter._moves_array, what a flush by the kernel or its graph
reads). The block books and the flush are tools/bench_demotions.py's; the whole steps tools/bench_host_step.py's.

--root PATH imports o3edge from another tree (a `git worktree` of an earlier commit) to measure against; a part
that tree lacks is left out.

  python tools/bench_router_plan.py [--root PATH] [--repeat 7] [--number 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import timeit
import types

import numpy as np

BS, NF, B, CTX, DEMOTIONS = 32, 4000, 16, 3872, 176


def router(KVRouter, RouterConfig):
    """A KVRouter with only what the timed parts read."""
    r = KVRouter.__new__(KVRouter)
    r.cfg, r.block_size, r.num_full_blocks = RouterConfig(), BS, NF
    r.books = types.SimpleNamespace(rows={s: s for s in range(B)}, row=lambda seq_id: seq_id)
    r.moves, r.plans, r.pending, r.due, r.share, r.released, r.step_no = [], {}, {}, [], 0, -1, 7
    r.prepared = r.deferred = None
    return r


def sequences(rng: random.Random) -> list:
    """B sequences whose sealed blocks are ~70% compressed already (a steady state between refreshes)."""
    seqs = []
    for s in range(B):
        n = CTX // BS + 1
        table = rng.sample(range(NF), n)
        for j in range(1, n - 5):
            if rng.random() < 0.7:
                table[j] = NF + j + s * 200
        seqs.append(types.SimpleNamespace(seq_id=s, block_table=table, num_computed_tokens=CTX - 1, num_output_tokens=9))
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--number", type=int, default=2000)
    a = ap.parse_args()
    sys.path.insert(0, a.root)
    import torch

    from o3edge.engine.router import KVRouter, RouterConfig

    rng = random.Random(0)
    r, seqs = router(KVRouter, RouterConfig), sequences(rng)
    routed = [(seq, CTX, seq.seq_id) for seq in seqs]
    held = torch.tensor([[rng.random() < 0.2 for _ in range(4096 // BS)] for _ in range(B)])
    plans = {}
    r._plan(routed, held, None, plans)
    pending = {}  # DEMOTIONS demotions spread over the sequences
    for seq_id, i in sorted(rng.sample([(s, i) for s, plan in plans.items() for i in range(len(plan))], DEMOTIONS)):
        pending.setdefault(seq_id, []).append(plans[seq_id][i])
    # an observing step's rows as each tree's fill_meta makes them: the entries read (split_rows, all rows at once);
    # or each row's full-precision table indices, compressed ones (and their block ids and the table's edits)
    batched, observing = hasattr(KVRouter, "split_rows"), hasattr(KVRouter, "_plan_observed")
    on_device = hasattr(KVRouter, "entry_rows")  # the rows' split and the plan's mask made on the device
    tables = []
    for seq in seqs:
        seq.table_edits = 0
        tables.append(np.asarray(seq.block_table, dtype=np.int32))

    def made_rows() -> list:
        if batched or on_device:
            return [(seq, t, 0) for seq, t in zip(seqs, tables)]
        rows = []
        for seq, t in zip(seqs, tables):
            full = t < NF
            index = np.flatnonzero(full)
            rows.append((seq, index, np.flatnonzero(~full), t[index], 0) if observing
                        else (seq, index, np.flatnonzero(~full)))
        return rows

    entries = np.zeros((B, 128 + 3), dtype=np.int64)

    def observed(rows):  # what a graph refresh's plan takes
        if on_device:
            r.entry_rows(rows, entries)
            return rows, entries
        return (rows, r.split_rows(rows)) if batched else rows

    rows = made_rows()
    # what a graph refresh's plan reads: the demotions among the entries, found on the device (untimed: a graph
    # replay on CUDA), in trees that do that; else the blocks holding a salient token
    holds = r.plan_mask(torch.from_numpy(observed(rows)[1]), held) if on_device else held

    def refresh_rows():  # the observing step's rows made, its observation's rows, its routing's plan
        rows = made_rows()
        if on_device:
            r.entry_rows(rows, entries)
            r._plan(routed, holds, None, {}, (rows, entries))
        elif batched:
            split = r.split_rows(rows)
            r.observation_meta(rows, 128, split)
            r._plan(routed, held, None, {}, (rows, split))
        else:
            r.observation_meta(rows, 128)
            r._plan(routed, held, None, {}, rows) if observing else r._plan(routed, held, None, {})

    moves = [(i, 3000 + i) for i in range(DEMOTIONS)]

    def make_due():
        r.pending, r.due, r.released, r.plans = {k: list(v) for k, v in pending.items()}, [], -1, {}
        r.make_due()

    def copy_pending():  # make_due's set-up alone, taken off its time
        r.pending, r.due, r.released, r.plans = {k: list(v) for k, v in pending.items()}, [], -1, {}

    def moves_array():
        r.moves = list(moves)
        return r._moves_array()

    def copy_moves():
        r.moves = list(moves)

    batch = [(seq, 1) for seq in seqs]

    prepared = ([(seq.seq_id, CTX) for seq in seqs], holds, None) + ((observed(rows),) if observing else ())

    def refresh_setup():  # a graph refresh step's routing, prepared on the device (its set-up, taken off its time)
        r.step_no, r.prepared, r.deferred = 31, prepared, None

    def refresh_end():  # that step's end: the routing deferred to the next step's
        refresh_setup()
        r.end_step(batch, decoding=True)

    def us(fn) -> float:
        return min(timeit.repeat(fn, number=a.number, repeat=a.repeat)) / a.number * 1e6

    parts = {}
    if on_device:
        parts["entry_rows (16 rows)"] = (lambda: r.entry_rows(rows, entries), None)
    else:
        meta_part = "observation_meta (16 rows" + (", the rows split in it)" if batched else ")")
        parts[meta_part] = (lambda: r.observation_meta(rows, 128), None)
    parts |= {f"_plan (16 sequences, {sum(map(len, plans.values()))} demotions)":
                 (lambda: r._plan(routed, held, None, {}), None),
             f"make_due ({DEMOTIONS} demotions)": (make_due, copy_pending),
             "end_step of a graph refresh step (16 sequences)": (refresh_end, refresh_setup)}
    if observing:
        split = observed(rows)  # (with split_rows: made once, as observation_meta and the plan share it)
        parts[f"_plan from the observing rows (16 sequences, {sum(map(len, plans.values()))} demotions)"] = (
            lambda: r._plan(routed, holds, None, {}, split), None)
    parts["a refresh's rows made, observed and planned from (16 sequences)"] = (refresh_rows, None)
    if hasattr(KVRouter, "_moves_array"):
        parts[f"_moves_array ({DEMOTIONS} moves)"] = (moves_array, copy_moves)
    else:
        parts[f"np.array of the moves ({DEMOTIONS})"] = (lambda: np.array(moves, dtype=np.int64), None)
    out = {name: round(us(fn) - (us(setup) if setup else 0.0), 2) for name, (fn, setup) in parts.items()}
    print(json.dumps({"root": a.root, "min us": out}))


if __name__ == "__main__":
    main()
