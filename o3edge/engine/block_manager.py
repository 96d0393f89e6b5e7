"""The paged KV cache's bookkeeping: blocks, reference counts and the prefix cache (no tensors).

Full blocks are named by a chained hash of (parent hash, token ids), rooted in the model's
fingerprint, so a block means the same thing in any request, and, later, in any process with
the same model. A block whose last holder finishes keeps its hash and stays findable until the
allocator needs its space: the free list is kept in least-recently-freed order.

With a cold tier (engine/cold_tier.py) the chain goes on past the hot hits: blocks the tier holds
are given fresh hot blocks and listed in `seq.cold_pending` for the engine to copy in, and count as
cached until `restored()` says how many arrived. Two hooks tell the tier's copier what happens:
`on_cached_free(block)` when a named block loses its last holder (offload it), `on_reuse(block_id)`
before a free block is handed out again (its outgoing copy must be made before it is overwritten).
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from operator import attrgetter
from typing import Callable, Protocol

from o3edge.engine.sequence import Sequence


_BLANK = hashlib.blake2b(digest_size=16)


def chain_hash(parent: bytes, token_ids) -> bytes:
    """The name of a full block: its tokens and everything before them."""
    return hashlib.blake2b(parent + array("i", token_ids).tobytes(), digest_size=16).digest()


def leading(mapping: dict, keys) -> list:
    """mapping's values for the leading keys it holds, up to the first it lacks (C loops: a long prefix is
    hundreds of names)."""
    values = list(map(mapping.get, keys))
    values.append(None)
    del values[values.index(None):]
    return values


def token_bytes(seq: Sequence, lo: int, hi: int) -> bytes:
    """seq.token_ids[lo:hi] as int32 bytes (what chain_hash hashes), from the checked prompt's copy when it
    has them."""
    prompt = seq.prompt_array
    if prompt is not None and len(prompt) >= hi:
        return memoryview(prompt)[lo:hi].tobytes()
    return array("i", seq.token_ids[lo:hi]).tobytes()


@dataclass(slots=True)  # attribute reads and writes without an instance dict: the books touch them per block
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    parent: bytes = b""  # the hash of the block before it (or the root)


class ColdLookup(Protocol):
    def match(self, hashes: list[bytes], parent: bytes, token_bytes: bytes) -> list[tuple[bytes, bytes, tuple]]:
        """(hash, parent, tokens) of the leading blocks of a chain that the tier holds (the chain's names
        from the one after parent on, and their token ids end to end as int32 bytes)."""


class BlockManager:
    """Hands out KV blocks to sequences and finds cached prefixes; plain Python, deterministic."""

    def __init__(self, num_blocks: int, block_size: int, fingerprint: str, prefix_caching: bool = True):
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.root = hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.num_named: dict[int, int] = {}  # seq_id -> its leading blocks named (seq.block_hashes[:n])
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_cold_hit_tokens = 0
        self.cold: ColdLookup | None = None
        self.on_cached_free: Callable[[Block], None] | None = None
        self.on_reuse: Callable[[int], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- admission -------------------------------------------------------------------------
    def match(self, seq: Sequence) -> list[int]:
        """Cached blocks that cover a prefix of seq; at least one token is always left to compute.
        Bulk, in C loops: the names looked up all at once, the hits' tokens compared end to end."""
        if not self.prefix_caching:
            return []
        bs, n = self.block_size, (len(seq) - 1) // self.block_size
        hits = leading(self.cached, self.chain(seq, n)[:n])
        blocks = self.blocks
        tokens = itertools.chain.from_iterable(map(attrgetter("token_ids"), map(blocks.__getitem__, hits)))
        if hits and list(tokens) != seq.token_ids[:len(hits) * bs]:  # a name on other tokens: up to there
            ids = seq.token_ids
            del hits[next(i for i, b in enumerate(hits) if blocks[b].token_ids != tuple(ids[i * bs:(i + 1) * bs])):]
        return hits

    def chain(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The names of seq's full blocks, at least its first num_blocks (maybe more), each hashed once in
        the sequence's life: a long prompt is matched at every admission try, then named as computed.
        The bytes hashed are taken from one int32 copy of the tokens (the prompt's is made when it is
        checked), not one copy per block."""
        hashes, bs = seq.block_hashes, self.block_size
        start = len(hashes)
        if start >= num_blocks:
            return hashes
        data = token_bytes(seq, start * bs, num_blocks * bs)
        h, step, blank = hashes[-1] if start else self.root, 4 * bs, _BLANK.copy
        for off in range(0, len(data), step):  # chain_hash, inlined (a copied blank hasher: 20% faster)
            hasher = blank()
            hasher.update(h)
            hasher.update(data[off:off + step])
            h = hasher.digest()
            hashes.append(h)
        return hashes

    def can_allocate(self, seq: Sequence, hits: list[int] | None = None) -> bool:
        """Whether seq's blocks fit; hits: match(seq), if the caller has it."""
        hits = self.match(seq) if hits is None else hits
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_for(len(seq)) - len(hits) + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, reuse: bool = True, hits: list[int] | None = None) -> None:
        """Give seq a block table for all its tokens, reusing cached prefix blocks if reuse (hits: match(seq),
        if the caller has it)."""
        assert not seq.block_table
        hits = (self.match(seq) if hits is None else hits) if reuse else []
        for block_id in hits:
            self._take(block_id)
        seq.block_table = hits + [self._take_free() for _ in range(self.blocks_for(len(seq)) - len(hits))]
        self.num_named[seq.seq_id] = len(hits)
        cold = self._match_cold(seq, seq.block_hashes[len(hits) - 1] if hits else self.root, len(hits)) if reuse else []
        seq.cold_pending = [(b, *c) for b, c in zip(seq.block_table[len(hits):], cold)]
        seq.num_cold_tokens = len(cold) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens = (len(hits) + len(cold)) * self.block_size
        self.num_queried_tokens += len(seq)
        self.num_hit_tokens += seq.num_cached_tokens

    def _match_cold(self, seq: Sequence, parent: bytes, start: int) -> list[tuple[bytes, bytes, tuple]]:
        """(hash, parent, tokens) of the blocks after the hot hits that the cold tier holds."""
        if self.cold is None or not self.prefix_caching:
            return []
        bs = self.block_size
        n = (len(seq) - 1) // bs
        return self.cold.match(self.chain(seq, n)[start:n], parent, token_bytes(seq, start * bs, n * bs))

    def restored(self, seq: Sequence, num_blocks: int) -> None:
        """The first num_blocks of seq.cold_pending arrived; the rest are recomputed."""
        pending, seq.cold_pending = seq.cold_pending, []
        self.num_named[seq.seq_id] = self.num_named.get(seq.seq_id, 0) + num_blocks
        for block_id, h, parent, tokens in pending[:num_blocks]:
            block = self.blocks[block_id]
            if block.hash is None and h not in self.cached:
                block.hash, block.parent, block.token_ids = h, parent, tokens
                self.cached[h] = block_id
        lost = (len(pending) - num_blocks) * self.block_size
        seq.num_computed_tokens -= lost
        seq.num_cached_tokens -= lost
        seq.num_cold_tokens -= lost
        self.num_hit_tokens -= lost
        self.num_cold_hit_tokens += seq.num_cold_tokens

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)  # least recently freed
        if self.on_reuse is not None:
            self.on_reuse(block_id)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    # ---- decode ----------------------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        return self.blocks_for(len(seq)) <= len(seq.block_table) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for seq's newest token."""
        if self.blocks_for(len(seq)) > len(seq.block_table):
            seq.block_table.append(self._take_free())

    def reserve_next(self, seq: Sequence) -> bool:
        """Give seq the block of the token after its newest now, if a block is free, so that a step
        launched ahead (cuda_graph.py) can write that token's K/V; False when none is free. Never
        preempts: the block would be taken one step later anyway, and goes back with seq's others."""
        if self.blocks_for(len(seq) + 1) <= len(seq.block_table):
            return True
        if self.num_free_blocks == 0:
            return False
        seq.block_table.append(self._take_free())
        return True

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Record that num_tokens more of seq's K/V are written; name the blocks this filled."""
        seq.num_computed_tokens += num_tokens
        if not self.prefix_caching:
            return
        bs, named, n = self.block_size, self.num_named.get(seq.seq_id, 0), seq.num_computed_tokens // self.block_size
        if named >= n:
            return
        names = self.chain(seq, n)
        for i in range(named, n):
            tokens, h = tuple(seq.token_ids[i * bs:(i + 1) * bs]), names[i]
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids, block.parent = h, tokens, names[i - 1] if i else self.root
                self.cached[h] = block.block_id
        self.num_named[seq.seq_id] = n

    def step_marker(self) -> Callable[[Sequence, int], None]:
        """The mark_computed the engine calls for each sequence of the step it ends (RouterBlocks: this one,
        where its own has nothing to add)."""
        return self.mark_computed

    # ---- release ---------------------------------------------------------------------------
    def free_seq(self, seq: Sequence) -> None:
        """Drop seq's hold on its blocks; unshared ones join the free list, most recent last."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._release(block)
        seq.block_table = []
        seq.cold_pending = []
        seq.num_computed_tokens = 0
        self.num_named.pop(seq.seq_id, None)

    def _release(self, block: Block) -> None:
        """A block lost its last holder: it joins the free list (a named one stays findable)."""
        self.free[block.block_id] = None
        if block.hash is not None and self.on_cached_free is not None:
            self.on_cached_free(block)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_free": self.num_free_blocks,
            "kv_blocks_used": self.num_blocks - self.num_free_blocks,
            "kv_blocks_cached": len(self.cached),
            "kv_block_size": self.block_size,
            "prefix_hit_rate": round(self.hit_rate, 4),
            "prefix_hit_tokens": self.num_hit_tokens,
            "cold_hit_tokens": self.num_cold_hit_tokens,
        }
