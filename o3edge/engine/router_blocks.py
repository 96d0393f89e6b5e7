"""The token router's block books: a demoted block gives its full-precision space back (no tensors).

Block ids 0 .. num_blocks - 1 are full-precision blocks, as in BlockManager. Ids from num_blocks up
are compressed blocks: id num_blocks + c is compressed block c, whose codes live in the bytes of
full-precision block c // per_host (its host; engine/router.py has the layout). A host lends its
bytes to per_host compressed blocks; it goes back to the free list when all of them are free and the
allocator needs it (`_take_free` with an empty free list), which drops what they cached.

Demoting the block at seq.block_table[i] (only when seq is its one holder):
  1. a named block is offered to the cold tier first (`on_cached_free`, the same hook a named block
     losing its last holder calls): its full-precision bytes may come back from there later;
  2. its K/V are to be quantized (the router's `move`: queued, and carried out for every block demoted
     since in one go by `flush_moves`, before a step reads the pools or a freed block is handed out);
  3. the codes go into a free compressed slot, least recently freed first (a cached compressed block
     there is dropped), or, when no slot is free, into the block's own bytes: the block becomes a host
     with per_host - 1 free slots (`on_reuse` first, so a pending cold-tier copy is made before);
  4. the table entry, the hash and the prefix-cache entry move to the compressed id; the full-precision
     block, when it did not become a host, joins the free list, first in line (it holds nothing).
A prefix hit on a compressed block is served from the compressed copy, under the same hash. A
compressed block that loses its last holder stays cached in its slot; it is never offered to the
cold tier (its full-precision bytes went there at step 1, when the tier had room).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Protocol

from o3edge.engine.block_manager import Block, BlockManager
from o3edge.engine.sequence import Sequence


class Demoter(Protocol):
    plans: dict  # seq_id -> demotions due now (mark_computed carries them out only when there are any)

    def move(self, pairs: list[tuple[int, int]]) -> None: ...
    def flush_moves(self) -> None: ...
    def take_plan(self, seq_id: int) -> list[tuple[int, int]]: ...


class RouterBlocks(BlockManager):
    """BlockManager with a compressed pool hosted inside the full-precision one."""

    def __init__(self, num_blocks: int, block_size: int, fingerprint: str, prefix_caching: bool, per_host: int):
        super().__init__(num_blocks, block_size, fingerprint, prefix_caching)
        self.num_full, self.per_host = num_blocks, per_host
        self.blocks += [Block(num_blocks + c) for c in range(num_blocks * per_host)]
        self.comp_free: OrderedDict[int, None] = OrderedDict()  # free compressed ids, least recently freed first
        self.host_free: dict[int, int] = {}  # host block -> how many of its compressed blocks are free
        self.num_reclaimable = 0  # hosts whose compressed blocks are all free
        self.num_demoted = 0  # ever
        self.demoter: Demoter | None = None

    @property
    def num_blocks(self) -> int:
        return self.num_full

    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + self.num_reclaimable

    @property
    def num_host_blocks(self) -> int:
        return len(self.host_free)

    def is_compressed(self, block_id: int) -> bool:
        return block_id >= self.num_full

    def _host(self, block_id: int) -> int:
        return (block_id - self.num_full) // self.per_host

    def held_blocks(self) -> tuple[int, int]:
        """(full-precision, compressed) blocks holding K/V: in use or cached."""
        full = sum(1 for b in self.blocks[:self.num_full] if (b.ref_count or b.hash is not None)
                   and b.block_id not in self.host_free)
        comp = sum(1 for b in self.blocks[self.num_full:] if b.ref_count or b.hash is not None)
        return full, comp

    # ---- the compressed free list --------------------------------------------------------------
    def _comp_unfree(self, block_id: int) -> None:
        del self.comp_free[block_id]
        self._host_unfree(block_id)

    def _host_unfree(self, block_id: int) -> None:
        """Compressed block block_id, off the free list, taken: one free slot fewer in its host."""
        host = self._host(block_id)
        if self.host_free[host] == self.per_host:
            self.num_reclaimable -= 1
        self.host_free[host] -= 1

    def _comp_free(self, block_id: int) -> None:
        self.comp_free[block_id] = None
        host = self._host(block_id)
        self.host_free[host] += 1
        if self.host_free[host] == self.per_host:
            self.num_reclaimable += 1

    def _forget_name(self, block: Block) -> None:
        if block.hash is not None and self.cached.get(block.hash) == block.block_id:
            del self.cached[block.hash]
        block.hash, block.token_ids = None, ()

    # ---- BlockManager's hooks --------------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        if not self.is_compressed(block_id):
            return super()._take(block_id)
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._comp_unfree(block_id)
        block.ref_count += 1

    def _release(self, block: Block) -> None:
        if self.is_compressed(block.block_id):
            self._comp_free(block.block_id)  # stays cached; its full-precision copy left at demotion
        else:
            super()._release(block)

    def _take_free(self) -> int:
        if self.demoter is not None:
            self.demoter.flush_moves()  # a block demoted since is read before it is handed out again
        if not self.free:
            self._reclaim_host()
        return super()._take_free()

    def _reclaim_host(self) -> None:
        """Give a host whose compressed blocks are all free back to the free list (dropping their names)."""
        host = next(h for h, n in self.host_free.items() if n == self.per_host)
        first = self.num_full + host * self.per_host
        for block_id in range(first, first + self.per_host):
            del self.comp_free[block_id]
            self._forget_name(self.blocks[block_id])
        del self.host_free[host]
        self.num_reclaimable -= 1
        self.free[host] = None

    def can_allocate(self, seq: Sequence, hits: list[int] | None = None) -> bool:
        hits = self.match(seq) if hits is None else hits
        revived = sum(1 for b in hits if not self.is_compressed(b) and self.blocks[b].ref_count == 0)
        # a compressed hit taken off the free list keeps its host from being reclaimed
        hosts = {self._host(b) for b in hits if self.is_compressed(b) and self.blocks[b].ref_count == 0}
        revived += sum(1 for h in hosts if self.host_free[h] == self.per_host)
        return self.blocks_for(len(seq)) - len(hits) + revived <= self.num_free_blocks

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Name the blocks this step filled, then carry out the router's demotions for seq."""
        super().mark_computed(seq, num_tokens)
        if self.demoter is not None and self.demoter.plans:
            self.carry_out(seq)

    def step_marker(self) -> Callable[[Sequence, int], None]:
        """BlockManager's mark_computed while the router has no demotion due: none is made due while a step's
        sequences are marked (plans come from the router's end_step and make_due, before; marking and the
        tokens' way back only take them away), so this one would find none for any of them. Its call, ~0.12 us
        a sequence, was ~2 us of the router's ordinary graph step at 16 sequences (py-spy on the CPU machine,
        tools/bench_host_step.py --setting router-int8 --refresh-steps 100000)."""
        if self.demoter is not None and self.demoter.plans:
            return self.mark_computed
        return super().mark_computed

    def carry_out(self, seq: Sequence) -> None:
        """The router's due demotions for seq (those of blocks still in its table where planned)."""
        plan = self.demoter.take_plan(seq.seq_id)
        if plan:
            table, n = seq.block_table, len(seq.block_table)
            self.demote_all(seq, [i for i, block_id in plan if i < n and table[i] == block_id])

    # ---- demotion --------------------------------------------------------------------------------
    def demote(self, seq: Sequence, i: int) -> bool:
        """Move seq.block_table[i] to the compressed pool and free its full-precision block; False when
        it is compressed already or shared."""
        return self.demote_all(seq, [i]) == 1

    def demote_all(self, seq: Sequence, indices: list[int]) -> int:
        """demote each of seq.block_table[indices] in turn; how many moved. One loop, the moves handed to the
        router in one call: a refresh demotes ~170 blocks of the built-in long model at 16 x 3,840 tokens in one
        step, whose host time a small model's GPU step does not hide (a refresh's books 0.23-0.30 -> 0.17-0.20 ms
        on the CPU machine: tools/bench_demotions.py, docs/results/cpu-router-books-2026-12-04/). A free slot's id is
        taken by one popitem: with the slot's books inlined as well, 176 demotions' books took 0.198-0.211 ms
        against 0.230-0.244 (tools/bench_demotions.py --device cpu --demotions 176, three alternating rounds);
        by _host_unfree and _forget_name, as now, 0.197-0.230 against 0.175-0.236 inlined, within this
        machine's noise (three alternating rounds)."""
        blocks, table, nf, ph = self.blocks, seq.block_table, self.num_full, self.per_host
        comp_free, host_free, cached, free = self.comp_free, self.host_free, self.cached, self.free
        on_cached_free, on_reuse, moves = self.on_cached_free, self.on_reuse, []
        for i in indices:
            old_id = table[i]
            old = blocks[old_id]
            if old_id >= nf or old.ref_count != 1:
                continue  # compressed already, or shared
            name = old.hash
            if name is not None and on_cached_free is not None:
                on_cached_free(old)  # the full-precision copy goes to the cold tier
            if comp_free:  # a free compressed slot, least recently freed first (a name cached there dropped)
                new_id = comp_free.popitem(last=False)[0]
                self._host_unfree(new_id)
                new = blocks[new_id]
                self._forget_name(new)
                free[old_id] = None
                free.move_to_end(old_id, last=False)  # holds nothing: handed out first
            else:  # the block's own bytes host it and per_host - 1 free compressed slots
                if on_reuse is not None:
                    on_reuse(old_id)
                new_id = nf + old_id * ph
                for block_id in range(new_id + ph - 1, new_id, -1):
                    comp_free[block_id] = None
                    comp_free.move_to_end(block_id, last=False)  # empty: handed out before cached ones
                host_free[old_id] = ph - 1
                new = blocks[new_id]
            moves.append((old_id, new_id - nf))
            new.ref_count, new.hash, new.token_ids, new.parent = 1, name, old.token_ids, old.parent
            if name is not None and cached.get(name) == old_id:
                cached[name] = new_id
            old.hash, old.token_ids, old.ref_count = None, (), 0
            table[i] = new_id
        if moves:
            seq.table_edits += 1
            self.demoter.move(moves)  # the data: at the next flush_moves
        self.num_demoted += len(moves)
        return len(moves)
