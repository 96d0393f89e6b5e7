"""The block manager alone: plain Python, no tensors, deterministic."""

from array import array

from o3edge.engine.block_manager import BlockManager
from o3edge.engine.sequence import SamplingParams, Sequence


def seq(tokens):
    return Sequence("r", list(tokens), SamplingParams())


def computed(bm, s):
    bm.allocate(s)
    bm.mark_computed(s, s.num_uncomputed)
    return s


def test_repeated_prefix_reuses_full_blocks_and_always_leaves_a_token_to_compute():
    bm = BlockManager(16, 4, "model-a")
    first = computed(bm, seq(range(10)))  # blocks: [0..3] [4..7] [8,9]
    again = seq(range(10))
    bm.allocate(again)
    assert again.num_cached_tokens == 8
    assert again.block_table[:2] == first.block_table[:2]
    assert again.block_table[2] != first.block_table[2]  # the partial block is private
    exact = seq(range(8))  # a prompt that is exactly two cached blocks still computes its last block
    bm.allocate(exact)
    assert exact.num_cached_tokens == 4


def test_different_model_fingerprint_or_tokens_do_not_hit():
    bm = BlockManager(16, 4, "model-a")
    computed(bm, seq(range(10)))
    other = BlockManager(16, 4, "model-b")
    computed(other, seq(range(10)))
    s = seq([0, 1, 2, 99, 4, 5, 6, 7, 8])
    bm.allocate(s)
    assert s.num_cached_tokens == 0
    assert bm.blocks[bm.cached[next(iter(bm.cached))]].hash not in other.cached


def test_refcounts_free_and_lru_eviction():
    bm = BlockManager(4, 4, "m")
    a = computed(bm, seq(range(9)))  # 3 blocks
    assert bm.num_free_blocks == 1
    bm.free_seq(a)
    assert bm.num_free_blocks == 4
    assert len(bm.cached) == 2  # freed full blocks stay findable
    b = seq(range(9))
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 8  # revived from the free list
    bm.free_seq(b)
    c = computed(bm, seq(range(100, 116)))  # needs all 4 blocks: evicts the cached ones
    assert c.num_cached_tokens == 0 and bm.num_free_blocks == 0
    assert len(bm.cached) == 4  # c's own four full blocks; the old prefix was evicted
    bm.free_seq(c)
    d = seq(range(9))
    bm.allocate(d)
    assert d.num_cached_tokens == 0


def test_shared_blocks_stay_until_last_holder_leaves():
    bm = BlockManager(8, 4, "m")
    a = computed(bm, seq(range(9)))
    b = seq(range(9))
    bm.allocate(b)
    shared = a.block_table[0]
    assert bm.blocks[shared].ref_count == 2
    bm.free_seq(a)
    assert bm.blocks[shared].ref_count == 1 and shared not in bm.free
    bm.free_seq(b)
    assert shared in bm.free


def test_decode_appends_blocks_and_names_them_when_full():
    bm = BlockManager(8, 4, "m")
    s = computed(bm, seq(range(3)))
    for t in range(3, 9):
        s.token_ids.append(t)
        assert bm.can_append(s)
        bm.append_slot(s)
        bm.mark_computed(s, 1)
    assert len(s.block_table) == 3
    assert len(bm.cached) == 2  # [0..3] and [4..7] are full and computed
    follow = seq(range(10))
    bm.allocate(follow)
    assert follow.num_cached_tokens == 8


def test_a_step_launched_ahead_gets_the_next_block_early_and_it_goes_back_with_the_sequence():
    bm = BlockManager(3, 4, "m")
    s = computed(bm, seq(range(2)))  # one block; positions 0-1 computed
    s.token_ids.append(2)  # this step computes position 2, a step queued behind it position 3
    assert bm.reserve_next(s) and len(s.block_table) == 1  # both in the first block
    bm.mark_computed(s, 1)
    s.token_ids.append(3)  # this step computes position 3; the queued one writes position 4
    assert bm.reserve_next(s) and len(s.block_table) == 2 and bm.num_free_blocks == 1
    bm.mark_computed(s, 1)
    s.token_ids.append(4)
    bm.append_slot(s)  # the scheduler finds position 4's block held
    assert len(s.block_table) == 2 and bm.num_free_blocks == 1
    other = computed(bm, seq(range(10, 13)))
    assert bm.num_free_blocks == 0
    s.token_ids += [5, 6, 7]
    bm.mark_computed(s, 3)  # positions 4-6; this step computes 7, a queued one would write 8
    assert not bm.reserve_next(s)  # position 8 starts a third block and none is free: no preemption
    bm.free_seq(s)
    bm.free_seq(other)
    assert bm.num_free_blocks == 3


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, 4, "m", prefix_caching=False)
    computed(bm, seq(range(10)))
    s = seq(range(10))
    bm.allocate(s)
    assert s.num_cached_tokens == 0 and not bm.cached


class FakeCold:
    """A cold tier as the block manager sees it: names it holds, plus what the hooks reported."""

    def __init__(self):
        self.held, self.freed, self.reused = {}, [], []

    def lookup(self, h, parent, tokens):
        return self.held.get(h) == (parent, tuple(tokens))

    def match(self, hashes, parent, token_bytes):
        """ColdTier.match, one block at a time."""
        tokens = array("i", token_bytes)
        found, bs = [], len(tokens) // max(1, len(hashes))
        for i, h in enumerate(hashes):
            block = tuple(tokens[i * bs:(i + 1) * bs])
            if not self.lookup(h, parent, block):
                break
            found.append((h, parent, block))
            parent = h
        return found


def with_cold(bm):
    cold = FakeCold()
    bm.cold = cold
    bm.on_cached_free = lambda b: (cold.freed.append(b.block_id), cold.held.__setitem__(b.hash, (b.parent, b.token_ids)))
    bm.on_reuse = cold.reused.append
    return cold


def test_cold_tier_continues_the_chain_after_the_hot_hits():
    bm = BlockManager(6, 4, "model-a")
    cold = with_cold(bm)
    first = computed(bm, seq(range(14)))  # three full named blocks and a partial one
    named, names = first.block_table[:3], set(first.block_hashes[:bm.num_named[first.seq_id]])
    bm.free_seq(first)
    assert sorted(cold.freed) == sorted(named)  # each named block was offered
    bm.free_seq(computed(bm, seq(range(100, 122))))  # takes all 6 blocks: the named ones are overwritten
    assert set(named) <= set(cold.reused) and not names & bm.cached.keys() and names <= cold.held.keys()
    again = seq(range(14))
    bm.allocate(again)
    assert again.num_cached_tokens == again.num_cold_tokens == 12
    assert [b for b, *_ in again.cold_pending] == again.block_table[:3]
    bm.restored(again, 2)  # the third failed its check: it is computed again
    assert (again.num_computed_tokens, again.num_cached_tokens, again.num_cold_tokens) == (8, 8, 8)
    assert bm.num_named[again.seq_id] == 2
    assert again.block_hashes[:2] == [bm.blocks[b].hash for b in again.block_table[:2]]
    assert bm.stats()["cold_hit_tokens"] == 8 and again.cold_pending == []
    bm.mark_computed(again, again.num_uncomputed)
    hot = seq(range(14))
    bm.allocate(hot)
    assert hot.num_cached_tokens == 12 and hot.num_cold_tokens == 0  # now all hot again


def test_cold_tier_match_checks_parent_and_tokens_and_stops_at_the_first_miss():
    bm = BlockManager(8, 4, "model-a")
    cold = with_cold(bm)
    bm.free_seq(computed(bm, seq(range(14))))
    bm.cached.clear()
    for b in bm.blocks:
        b.hash = None
    h1 = next(h for h, (parent, _) in cold.held.items() if parent == bm.root)
    del cold.held[h1]  # the first block is gone: nothing after it can be used
    s = seq(range(14))
    bm.allocate(s)
    assert s.num_cold_tokens == 0 and s.cold_pending == []


def test_chain_names_are_chain_hash_whether_from_the_checked_prompt_or_the_token_list():
    from o3edge.engine.block_manager import chain_hash

    for bs in (8, 16):
        bm = BlockManager(4, bs, "model-a")
        ids = list(range(1000, 1000 + 5 * bs + 3))
        plain = seq(ids)
        checked = Sequence("r", list(ids), SamplingParams(), prompt_array=array("i", ids[:3 * bs]))  # shorter
        want, parent = [], bm.root
        for i in range(5):
            parent = chain_hash(parent, ids[i * bs:(i + 1) * bs])
            want.append(parent)
        assert bm.chain(plain, 2) == want[:2] and bm.chain(plain, 5) == want
        assert bm.chain(checked, 3) == want[:3] and bm.chain(checked, 5) == want
