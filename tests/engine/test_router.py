"""The token router: KV quantizers, routing policy, two-pool attention, the compressed-pool kernel, the engine."""

import numpy as np
import pytest
import torch

from o3edge import O3Config, O3Model
from o3edge.engine.kernels.quant_attention import quant_attention_partial, quant_attention_reference
from o3edge.engine.kv_quant import dequantize, hadamard, quantize, unpack_int4
from o3edge.engine.router import (KVRouter, RouterConfig, SaliencyBooks, blocks_to_demote, covering_blocks,
                                  holding_blocks, salient_rows)
from o3edge.engine.sequence import SamplingParams, Sequence
from o3edge.errors import ConfigError

PROMPT = "You are a careful assistant who answers questions about the Python standard library. " * 6
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
ROUTED = dict(kv_block_size=8, sink_tokens=4, recent_tokens=16, router_refresh_steps=4)


def load(path, **kw):
    return O3Model.from_config(O3Config(model_path=path, device="cpu", **kw))


# ---- quantizers --------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_round_trip_error_is_within_half_a_step(mode):
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.rand(50, 3, 1) * 4
    rot = hadamard(64) if mode == "int4" else None
    codes, scales = quantize(x, mode, rot)
    assert codes.shape[-1] == (64 if mode == "int8" else 32) and scales.dtype == torch.float16
    back = dequantize(codes, scales, mode, rot)
    basis = x @ rot if rot is not None else x  # the error bound holds in the basis that was quantized
    step = scales.float()[..., None]
    err = (dequantize(codes, scales, mode, rot, unrotate=False) - basis).abs()
    assert (err <= step * 0.5 + 1e-3 * basis.abs().amax(-1, keepdim=True)).all()
    assert torch.allclose(back.norm(dim=-1), x.norm(dim=-1), rtol=0.2 if mode == "int4" else 0.02)


def test_int4_codes_unpack_to_their_nibbles_for_every_byte():
    """Every byte value: the low nibble is the even dimension, both read as two's complement in [-8, 7],
    for codes of any leading shape."""
    codes = torch.arange(256, dtype=torch.uint8).view(4, 2, 32)
    want = [[(b & 0xF) - 16 * (b & 0x8 > 0), (b >> 4) - 16 * (b >> 7)] for b in range(256)]
    got = unpack_int4(codes)
    assert got.shape == (4, 2, 64)
    assert got.reshape(-1, 2).tolist() == [[float(lo), float(hi)] for lo, hi in want]


def test_hadamard_is_orthonormal_and_its_own_inverse_for_any_head_dim():
    for n in (64, 128, 96):
        h = hadamard(n, dtype=torch.float64)
        assert torch.allclose(h @ h, torch.eye(n, dtype=torch.float64), atol=1e-12)
        assert torch.equal(h, h.T)


def test_rotation_cuts_int4_error_on_an_outlier_channel():
    torch.manual_seed(1)
    x = torch.randn(256, 64)
    x[:, 5] *= 30  # one outlier channel, as keys have
    plain = (dequantize(*quantize(x, "int4"), "int4") - x).norm() / x.norm()
    rot = hadamard(64)
    rotated = (dequantize(*quantize(x, "int4", rot), "int4", rot) - x).norm() / x.norm()
    assert rotated < 0.6 * plain


# ---- policy ------------------------------------------------------------------------------------

def salient_positions(saliency, threshold):
    return salient_rows([saliency], threshold)[0]


def test_salient_set_is_the_smallest_covering_the_threshold():
    s = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05], dtype=torch.float64)
    assert salient_positions(s, 0.85).tolist() == [False, True, True, True, False]  # 0.9 >= 0.85
    assert salient_positions(s, 0.8).tolist() == [False, True, False, True, False]
    assert not salient_positions(s, 0.0).any()


def test_rows_routed_together_choose_what_each_alone_would():
    """A step routes all its due sequences in one sort: rows of different lengths (zero padding) get
    the same salient sets, and the same blocks holding one, as each routed alone."""
    torch.manual_seed(3)
    rows = [torch.rand(n, dtype=torch.float64) ** 6 for n in (40, 97, 64, 8)]
    rows.append(torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5], dtype=torch.float64))  # ties at 0
    together = salient_rows(rows, 0.85)
    for i, r in enumerate(rows):
        alone = salient_rows([r], 0.85)[0]
        assert torch.equal(together[i, :r.numel()], alone) and not together[i, r.numel():].any()
        covered = float(r[alone].sum())
        assert covered >= 0.85 * float(r.sum()) - 1e-12  # covers the threshold...
        assert covered - float(r[alone].min()) < 0.85 * float(r.sum())  # ...and no smaller set does
    assert holding_blocks(rows, 0.85, 8) == [holding_blocks([r], 0.85, 8)[0] for r in rows]
    assert [len(h) for h in holding_blocks(rows, 0.85, 8)] == [5, 12, 8, 1, 1]


def test_sinks_and_recent_window_are_never_demoted():
    torch.manual_seed(2)
    cfg = RouterConfig("int8", threshold=0.5, sink_tokens=5, recent_tokens=20)
    for ctx in (40, 57, 64, 100):
        s = torch.rand(ctx, dtype=torch.float64) ** 8  # a few salient tokens
        out = blocks_to_demote(holding_blocks([s], 0.5, 8)[0], ctx, 8, cfg, [False] * (ctx // 8))
        assert out  # the policy does demote
        for i in out:
            assert i * 8 >= 5 and (i + 1) * 8 <= ctx - 20 and (i + 1) * 8 <= ctx
            assert not salient_positions(s, 0.5)[i * 8:(i + 1) * 8].any()


def test_a_refresh_plans_every_sequence_as_it_would_plan_each_alone():
    """KVRouter._plan plans all routed sequences at once: per sequence, the blocks blocks_to_demote picks
    (not salient, not pinned, not yet demoted), as (table index, block id) in table order; sequences no
    longer followed or whose table shrank (preempted) are passed over."""
    rng = np.random.default_rng(4)
    cfg = RouterConfig("int8", threshold=0.85, sink_tokens=4, recent_tokens=20)
    nf, bs = 500, 8
    router = KVRouter.__new__(KVRouter)  # the planning needs only these, no pools
    router.cfg, router.block_size, router.num_full_blocks = cfg, bs, nf
    router.books = SaliencyBooks(512, "cpu")
    routed = []
    for i, ctx in enumerate((40, 97, 203, 64, 150, 88)):
        table = [int(b) if rng.random() < 0.6 else nf + int(b) for b in rng.integers(0, nf, -(-ctx // bs))]
        seq = Sequence(seq_id=i, request_id=str(i), token_ids=[1] * ctx, params=GREEDY, block_table=table)
        if i != 4:  # sequence 4 has ended
            router.books.row(i)
        routed.append((seq, ctx, i))
    routed[5][0].block_table = routed[5][0].block_table[:3]  # preempted and readmitted: a shorter table
    holds = torch.from_numpy(rng.random((len(routed), 203 // bs)) < 0.3)
    plans = {}
    router._plan(routed, holds, None, plans)
    expected = {}
    for (seq, ctx, _), held in zip(routed[:4], holds.numpy()):
        table = seq.block_table[:ctx // bs]
        alone = blocks_to_demote(held, ctx, bs, cfg, np.asarray(table) >= nf)
        if alone:
            expected[seq.seq_id] = [(i, table[i]) for i in alone]
    assert plans == expected and len(expected) >= 3 and sum(map(len, plans.values())) > 10
    assert 4 not in plans and 5 not in plans


def test_a_refresh_planned_from_its_observing_rows_plans_what_its_tables_give():
    """A graph refresh plans from the rows its observing step read (each sequence's table entries, router_graph.py),
    its demotions found on the device (plan_mask) instead of from the tables on the host: the same plans in the
    same order, for sinks and recent windows of any size; an entry demoted since that step (a refresh's demotions
    due before, with a short router_refresh_steps) is not planned again."""
    rng = np.random.default_rng(5)
    nf, bs, width = 500, 8, 40
    for sink, recent in ((4, 20), (0, 0), (9, 3), (16, 64)):
        cfg = RouterConfig("int8", threshold=0.85, sink_tokens=sink, recent_tokens=recent)
        router = KVRouter.__new__(KVRouter)
        router.cfg, router.block_size, router.num_full_blocks = cfg, bs, nf
        router.books = SaliencyBooks(512, "cpu")
        routed, observed = [], []
        for i, ctx in enumerate((40, 97, 203, 64, 150, 88, 9)):
            n = -(-ctx // bs)
            table = [int(b) if rng.random() < 0.6 else nf + int(b) for b in rng.integers(0, nf, n + (i % 2))]
            seq = Sequence(seq_id=i, request_id=str(i), token_ids=[1] * ctx, params=GREEDY, block_table=table)
            seq.num_computed_tokens = ctx - 1  # the observer's position
            if i != 4:  # sequence 4 has ended
                router.books.row(i)
            routed.append((seq, ctx, i))
            observed.append((seq, np.asarray(table[:n], dtype=np.int32), seq.table_edits))  # the entries read
        routed[5][0].block_table = routed[5][0].block_table[:3]  # preempted and readmitted: a shorter table
        holds = torch.from_numpy(rng.random((len(routed), 512 // bs)) < 0.3)
        entries = np.full((len(observed), width + 3), 777, dtype=np.int64)  # past each row's entries: anything
        router.entry_rows(observed, entries)
        router.books.release(4)  # (entry_rows gave every row's sequence a book row: 4 has ended since)
        mask = router.plan_mask(torch.from_numpy(entries), holds)
        tables, plans = {}, {}
        router._plan(routed, holds, None, tables)
        router._plan(routed, mask, None, plans, (observed, entries))
        assert plans == tables and 4 not in plans
        assert sum(map(len, plans.values())) > 10 or recent == 64
        seq = routed[2][0]  # one of its planned entries demoted since the observing step
        i, block_id = tables[seq.seq_id][1]
        seq.block_table[i], seq.table_edits = nf + 7, seq.table_edits + 1
        plans = {}
        router._plan(routed, mask, None, plans, (observed, entries))
        assert plans[seq.seq_id] == [p for p in tables[seq.seq_id] if p[0] != i]


def test_an_observing_steps_rows_are_split_into_their_pools_on_the_device():
    """observation_of, from the rows' entries (entry_rows): each row's full-precision table indices from column 0,
    its compressed ones from column width, its keys in each pool, its book row and its context; rows with nothing
    compressed, nothing at full precision, or no entry at all among them, and padding rows of zeros."""
    rng = np.random.default_rng(6)
    nf, bs, width = 300, 8, 40
    router = KVRouter.__new__(KVRouter)
    router.block_size, router.num_full_blocks = bs, nf
    router.books = SaliencyBooks(width * bs, "cpu")
    rows = []
    for i, n in enumerate((12, 1, 40, 7, 0, 25)):
        table = [int(b) + (nf if rng.random() < [0.5, 0.0, 0.7, 1.0, 0.5, 0.3][i] else 0)
                 for b in rng.integers(0, nf, n)]
        seq = Sequence(seq_id=10 + i, request_id=str(i), token_ids=[1] * (n * bs), params=GREEDY, block_table=table)
        seq.num_computed_tokens = max(0, n * bs - 3)
        rows.append((seq, np.asarray(table, dtype=np.int32), 0))
    entries = np.full((len(rows) + 2, width + 3), nf - 1, dtype=np.int64)  # stale entries past each row's
    entries[len(rows):] = 0
    router.entry_rows(rows, entries)
    meta = router.observation_of(torch.from_numpy(entries)).numpy()
    assert meta.shape == (len(rows) + 2, 2 * width + 4) and not meta[len(rows):].any()
    for b, (seq, t, _) in enumerate(rows):
        full, comp = np.flatnonzero(t < nf), np.flatnonzero(t >= nf)
        expected = np.zeros(2 * width + 4, dtype=np.int64)
        expected[:len(full)], expected[width:width + len(comp)] = full, comp
        pos = seq.num_computed_tokens
        expected[2 * width:] = (pos + 1 - len(comp) * bs, len(comp) * bs, router.books.row(seq.seq_id), pos + 1)
        assert meta[b].tolist() == expected.tolist()


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_a_refresh_plans_become_due_whole_or_a_share_a_step(steps):
    """KVRouter.make_due hands a refresh's plans to `plans` once a step: in one step (each sequence's plan
    whole, after what `plans` holds for it already) or a share a step over `steps` steps; either way the
    same demotions in the same order, and a second call in the same step hands over nothing more."""
    router = KVRouter.__new__(KVRouter)  # the hand-over needs only these, no pools
    router.cfg = RouterConfig("int8", demotion_steps=steps)
    router.plans, router.due, router.share, router.released, router.step_no = {7: [(0, 3)]}, [], 0, -1, 10
    pending = {7: [(2, 11), (5, 12)], 8: [(1, 20)], 9: [(3, 30), (4, 31), (6, 32)]}
    router.pending = {k: list(v) for k, v in pending.items()}
    handed = []
    for _ in range(steps):
        router.make_due()
        router.make_due()  # the graph path calls it again at the step's end: no second share
        handed.append(sum(map(len, router.plans.values())))
        router.step_no += 1
    assert router.plans == {7: [(0, 3)] + pending[7], 8: pending[8], 9: pending[9]}
    assert not router.pending and not router.due
    assert handed == [1 + min(6, -(-6 // steps) * (k + 1)) for k in range(steps)]  # a share: 6 / steps, rounded up


def test_covering_blocks_keep_the_fewest_blocks_that_cover_the_threshold():
    """router_select = "blocks": the sink and recent blocks and the tail count first, demoted blocks never
    come back, and the kept blocks are the fewest, most salient first, that bring the full-precision share
    to the threshold; the token rule keeps at least as many blocks for the same guarantee."""
    torch.manual_seed(3)
    cfg = RouterConfig("int8", threshold=0.85, sink_tokens=4, recent_tokens=20, select="blocks")
    for ctx in (64, 100, 203, 400):
        s = (torch.rand(ctx, dtype=torch.float64) ** 6).numpy()  # a few salient tokens, the rest spread
        n = ctx // 8
        mass = s[:n * 8].reshape(n, 8).sum(1)
        demoted = [i % 5 == 3 for i in range(n)]
        keep = covering_blocks(mass, s.sum(), ctx, 8, cfg, demoted)
        lo = np.arange(n) * 8
        forced = (lo < 4) | (lo + 8 > ctx - 20)
        assert keep[forced].all() and not (keep & np.asarray(demoted) & ~forced).any()
        full = mass[keep & ~np.asarray(demoted)].sum() + s[n * 8:].sum()
        chosen, left = np.flatnonzero(keep & ~forced), np.flatnonzero(~keep & ~np.asarray(demoted))
        if len(left):  # not every block kept: the threshold is covered...
            assert full >= 0.85 * s.sum() - 1e-9
            assert mass[left].max() <= mass[chosen].min() if len(chosen) else True  # ...most salient first...
        if len(chosen):  # ...and dropping the least salient kept block would not cover it
            assert full - mass[chosen].min() < 0.85 * s.sum()
        by_tokens = np.asarray(holding_blocks([torch.from_numpy(s)], 0.85, 8)[0], dtype=bool) | forced
        fresh = covering_blocks(mass, s.sum(), ctx, 8, cfg, [False] * n)
        assert fresh.sum() <= by_tokens.sum()
        demote = blocks_to_demote(fresh, ctx, 8, cfg, [False] * n)
        assert sorted(demote) == np.flatnonzero(~fresh).tolist()


# ---- two-pool attention --------------------------------------------------------------------------

def demote_by_hand(router, block_id, comp):
    """Quantize full-precision block block_id into compressed block comp; its id in a table becomes this."""
    router.move([(block_id, comp)])
    router.flush_moves()
    return router.num_full_blocks + comp


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_two_pool_attention_equals_dequantize_then_attend(mode):
    """A sequence with some blocks demoted: the merged result equals one softmax over full-precision
    keys where they stayed and dequantized keys where they were demoted."""
    torch.manual_seed(3)
    L, bs, KVH, H, hd, nblocks = 2, 8, 2, 6, 64, 12
    kv = torch.randn(L, 2, (nblocks + 1) * bs, KVH, hd)
    ref = kv.clone()
    router = KVRouter(RouterConfig(mode), kv, nblocks, bs, 1)
    seq = Sequence("s", list(range(41)), GREEDY)
    # blocks 1 and 3 demoted into compressed blocks hosted by block 11 (its bytes become codes)
    c1, c3 = 11 * router.per_host, 11 * router.per_host + 1
    seq.block_table = [0, demote_by_hand(router, 1, c1), 2, demote_by_hand(router, 3, c3), 4, 5]
    seq.num_computed_tokens = 37  # 4 queries: positions 37..40
    step = router.begin_step([(seq, 4)])
    q = torch.randn(4, H, hd)
    out = step.attend(1, q, kv[1, 0], kv[1, 1])
    k, v = ref[1, 0, :41].clone(), ref[1, 1, :41].clone()
    for b, c in ((1, c1), (3, c3)):
        r, rc = slice(b * bs, (b + 1) * bs), slice(c * bs, (c + 1) * bs)
        k[r] = dequantize(router.codes[1, 0, rc], router.scales[1, 0, rc], mode, router.rotation)
        v[r] = dequantize(router.codes[1, 1, rc], router.scales[1, 1, rc], mode, router.rotation)
    assert torch.equal(kv[:, :, :11 * bs], ref[:, :, :11 * bs])  # only the host's bytes were written
    scores = torch.einsum("nhd,shd->hns", q, k.repeat_interleave(3, 1)) * hd ** -0.5
    scores = scores.masked_fill(torch.arange(41)[None, None] > torch.arange(37, 41)[None, :, None], float("-inf"))
    want = torch.einsum("hns,shd->nhd", torch.softmax(scores, -1), v.repeat_interleave(3, 1))
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk", [(0, 41), (24, 17)])
def test_a_prompt_chunk_attends_and_observes_as_one_softmax_does(chunk):
    """A prompt's queries over full-precision keys alone (fused attention, only the observed queries' scores
    made): the output is one causal softmax over the keys up to each query, and the books gain the last
    obs_window queries' probabilities, averaged over the heads: whole prompts and later chunks alike."""
    check_prompt_chunk(chunk, "cpu", torch.float32, atol=2e-5, books_atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [(0, 41), (24, 17), (0, 1000), (512, 488)])
def test_a_prompt_chunk_on_the_gpu_attends_and_observes_as_one_softmax_does(chunk):
    """The same on CUDA with a bfloat16 cache, where a prompt's queries go through flash attention in the
    cache's dtype (the probabilities rounded to bfloat16 before they weight the values): a whole prompt by
    its causal mask, a later chunk by the bottom-right one."""
    check_prompt_chunk(chunk, "cuda", torch.bfloat16, atol=2e-2, books_atol=1e-5)


def check_prompt_chunk(chunk, device, dtype, atol, books_atol):
    start, n = chunk
    torch.manual_seed(4)
    L, bs, KVH, H, hd = 2, 8, 2, 6, 16
    ctx = start + n
    nblocks = -(-ctx // bs) + 2
    kv = torch.randn(L, 2, (nblocks + 1) * bs, KVH, hd).to(dtype)
    cfg = RouterConfig("int8", obs_window=5)
    router = KVRouter(cfg, kv.to(device), nblocks, bs, 1)
    seq = Sequence("p", list(range(ctx)), GREEDY)
    seq.block_table = torch.randperm(nblocks, generator=torch.Generator().manual_seed(5))[:-(-ctx // bs)].tolist()
    seq.num_computed_tokens = start
    step = router.begin_step([(seq, n)])
    q = torch.randn(n, H, hd).to(dtype)
    out = step.attend(1, q.to(device), router.kv_cache[1, 0], router.kv_cache[1, 1]).cpu().float()
    slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(ctx)])
    k, v = kv[1, 0, slots].float().repeat_interleave(3, 1), kv[1, 1, slots].float().repeat_interleave(3, 1)
    scores = torch.einsum("nhd,shd->hns", q.float(), k) * hd ** -0.5
    scores = scores.masked_fill(torch.arange(ctx)[None, None] > torch.arange(start, ctx)[None, :, None], float("-inf"))
    probs = torch.softmax(scores, -1)
    torch.testing.assert_close(out, torch.einsum("hns,shd->nhd", probs, v), atol=atol, rtol=1e-4 if atol < 1e-3 else 2e-2)
    want = probs[:, -5:].mean(0).sum(0).double()  # what layer 1 adds: the last 5 queries, mean over heads
    torch.testing.assert_close(router.books.mass[router.books.row(seq.seq_id), :ctx].cpu(), want, atol=books_atol,
                               rtol=10 * books_atol)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype", [(8, 2, 64, torch.float32), (6, 3, 128, torch.float32),
                                                           (4, 4, 64, torch.float32), (8, 2, 64, torch.bfloat16),
                                                           (6, 3, 128, torch.float16)])
def test_decoding_queries_over_both_pools_in_cpu_kernels_match_torch(mode, heads, kv_heads, head_dim, dtype,
                                                                     monkeypatch):
    """On a CPU cache (float32, bfloat16 or float16) a step's decoding queries attend over both pools in one C++
    call a layer (cpu_router.cpp): beside a prompt chunk (torch's operations), with blocks demoted, INT4's rotation
    and GQA groups, and a sequence with nothing demoted, the output matches torch's operations' on the same cache
    (O3EDGE_ROUTER_NATIVE=0)."""
    from o3edge.engine import cpu_ext

    if not cpu_ext.attention_available():
        pytest.skip("o3edge's CPU attention does not build here (AVX2 or a compiler missing)")
    torch.manual_seed(8)
    L, bs = 2, 16
    kv = torch.randn(L, 2, 25 * bs, kv_heads, head_dim).to(dtype)
    outs = []
    for native in ("1", "0"):
        monkeypatch.setenv("O3EDGE_ROUTER_NATIVE", native)
        cache = kv.clone()
        router = KVRouter(RouterConfig(mode), cache, 24, bs, 1)
        assert router.native == (native == "1")
        a = Sequence("a", list(range(7 * bs - 5)), GREEDY)  # decoding, three blocks demoted
        a.token_ids += [1, 2]  # two tokens generated: its step's query decodes
        a.block_table = list(range(7))
        for n, b in enumerate((1, 2, 4)):
            a.block_table[b] = demote_by_hand(router, b, 22 * router.per_host + n)
        a.num_computed_tokens = 7 * bs - 4
        b = Sequence("b", list(range(5 * bs - 3)), GREEDY)  # decoding, nothing demoted
        b.token_ids += [3]
        b.block_table, b.num_computed_tokens = list(range(7, 12)), 5 * bs - 3
        c = Sequence("c", list(range(4 * bs)), GREEDY)  # a prompt chunk of three queries, not its last
        c.block_table, c.num_computed_tokens = list(range(12, 16)), 2 * bs
        step = router.begin_step([(a, 1), (c, 3), (b, 1)])
        assert len(step.others) == (1 if native == "1" else 3)
        q = torch.randn(5, heads, head_dim, generator=torch.Generator().manual_seed(9))
        outs.append(step.attend(1, q, cache[1, 0], cache[1, 1]))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)


def test_a_head_dim_the_cpu_kernel_cannot_tile_stays_on_torch():
    """head_dim 72 (not a multiple of the kernel's 16-float vectors) or a cache type the kernel does not read
    (float64): the router attends by torch's operations instead of refusing the step."""
    assert not KVRouter(RouterConfig("int8"), torch.zeros(1, 2, 4 * 8, 2, 72), 3, 8, 1).native
    assert not KVRouter(RouterConfig("int8"), torch.zeros(1, 2, 4 * 8, 2, 64, dtype=torch.float64), 3, 8, 1).native


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_two_pool_decode_on_the_gpu_matches_the_cpu(mode):
    """On CUDA a decode query's compressed part runs in the Triton kernel; the merged result matches
    the CPU's torch path on the same cache."""
    torch.manual_seed(6)
    L, bs, KVH, H, hd = 2, 16, 2, 8, 64
    kv = torch.randn(L, 2, 12 * bs, KVH, hd)
    outs = []
    for dev in ("cpu", "cuda"):
        cache = kv.clone().to(dev)
        router = KVRouter(RouterConfig(mode), cache, 11, bs, 1)
        seq = Sequence("s", list(range(7 * bs - 3)), GREEDY)
        seq.block_table = list(range(7))
        for n, b in enumerate((1, 2, 4)):
            seq.block_table[b] = demote_by_hand(router, b, 10 * router.per_host + n)
        seq.num_computed_tokens = 7 * bs - 4
        step = router.begin_step([(seq, 1)])
        q = torch.randn(1, H, hd, generator=torch.Generator().manual_seed(7)).to(dev)
        outs.append(step.attend(0, q, cache[0, 0], cache[0, 1]).cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


# ---- the compressed-pool kernel (Triton; the interpreter on CPU) -----------------------------------

@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", [(16, 6, 2, 64), (8, 4, 4, 64), (32, 8, 1, 128),
                                                                 (24, 9, 3, 64), (16, 4, 2, 96)])
def test_kernel_matches_dequantize_then_attend(mode, block_size, heads, kv_heads, head_dim):
    torch.manual_seed(4)
    slots = 9 * block_size
    kv = torch.randn(2, slots, kv_heads, head_dim) * 2
    codes, scales = quantize(kv, mode, hadamard(head_dim) if mode == "int4" else None)
    q = torch.randn(4, heads, head_dim)
    table = torch.tensor([[3, 1, 7, 0, 8], [5, 2, 0, 0, 0], [0, 0, 0, 0, 0], [6, 0, 0, 0, 0]], dtype=torch.int32)
    counts = torch.tensor([5, 2, 0, 1], dtype=torch.int32)  # odd counts, an empty row, one block
    o, lse = quant_attention_partial(q, table, codes, scales, mode, block_size, counts)
    o_ref, lse_ref = quant_attention_reference(q, table, codes, scales, mode, block_size, counts)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=1e-5)
    assert torch.isinf(lse[2]).all() and (o[2] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_kernel_matches_reference_on_the_gpu(mode):
    torch.manual_seed(5)
    dev = "cuda"
    kv = torch.randn(2, 64 * 32, 8, 64, device=dev)
    codes, scales = quantize(kv, mode, hadamard(64, device=dev) if mode == "int4" else None)
    q = torch.randn(16, 32, 64, device=dev)
    table = torch.randint(0, 64, (16, 40), dtype=torch.int32, device=dev)
    counts = torch.randint(0, 41, (16,), dtype=torch.int32, device=dev)
    o, lse = quant_attention_partial(q, table, codes, scales, mode, 32, counts)
    o_ref, lse_ref = quant_attention_reference(q, table, codes, scales, mode, 32, counts)
    torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-4)


def test_saliency_books_keep_each_sequence_its_row_and_grow_without_losing_any():
    books = SaliencyBooks(10, torch.device("cpu"), rows=2)
    a, b = books.row(1), books.row(2)
    books.mass[a, :3], books.count[a, :3], books.mass[b, 5] = 1.0, 2.0, 4.0
    books.row(3)  # a third sequence: the table doubles, the first two keep their rows and books
    assert books.mass.shape[0] == 4 and books.row(1) == a and books.row(2) == b
    sal = books.saliency([a, b], [3, 6])  # mass / observers, 0 past each row's context
    assert sal.tolist() == [[0.5, 0.5, 0.5, 0, 0, 0], [0, 0, 0, 0, 0, 4.0]]
    books.release(1)
    reused = books.row(4)  # a finished sequence's row comes back empty
    assert reused == a and float(books.mass[reused].abs().sum() + books.count[reused].abs().sum()) == 0
    with torch.inference_mode():  # a step's inference mode grows the table...
        for seq_id in (5, 6):
            books.row(seq_id)
    assert books.mass.shape[0] == 8
    books.release(6)  # ...and a sequence that ends is released outside it


# ---- the engine ----------------------------------------------------------------------------------

def test_router_settings_are_checked():
    for bad in (dict(kv_router="int2"), dict(router_threshold=1.5), dict(recent_tokens=-1),
                dict(router_select="heads")):
        with pytest.raises(ConfigError):
            O3Config(**bad)


@pytest.mark.parametrize("mode, select", [("int8", "tokens"), ("int4", "tokens"), ("int8", "blocks")])
def test_router_on_is_deterministic_and_demotes_only_eligible_blocks(tiny_dir, mode, select):
    runs = []
    for _ in range(2):
        m = load(tiny_dir, kv_router=mode, router_select=select, **ROUTED)
        eng = m.engine
        prompts = [eng.encode(PROMPT + f"What is module {i}?") for i in range(3)]
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, GREEDY)
        outs, checked = {}, 0
        while eng.has_unfinished_requests():
            for out in eng.step()[0]:
                outs.setdefault(out.request_id, []).extend(out.token_ids)
            for seq in eng.scheduler.running:  # sinks and the recent window stay full precision
                ctx = seq.num_computed_tokens
                for i, block_id in enumerate(seq.block_table[:-(-ctx // 8)]):
                    if i * 8 < 4 or (i + 1) * 8 > ctx - 16:
                        assert not eng.blocks.is_compressed(block_id)
                        checked += 1
        assert checked and eng.blocks.num_demoted > 0
        runs.append([outs[str(i)] for i in range(3)])
    assert runs[0] == runs[1]


def test_a_prompt_whose_last_chunk_is_one_token_is_routed_when_it_ends(tiny_dir):
    """A prompt prefilled in chunks whose last chunk is a single token (as a decode step's is) is still
    routed in the step that ends it, like a prompt prefilled at once: at threshold 0 every eligible block
    is demoted there, before any decode step."""
    demoted, ids = [], load(tiny_dir, **ROUTED).engine.encode(PROMPT)
    for last in (None, 1):
        chunk = {} if last is None else dict(max_num_batched_tokens=len(ids) - last)
        eng = load(tiny_dir, kv_router="int8", router_threshold=0, **chunk, **ROUTED).engine
        eng.add_request("r", ids, SamplingParams(max_new_tokens=2, ignore_eos=True))
        seq, steps = eng.seqs["r"], []
        while seq.num_output_tokens == 0:  # the prompt's steps
            before = seq.num_computed_tokens
            eng.step()
            steps.append(seq.num_computed_tokens - before)
        assert steps == ([len(ids)] if last is None else [len(ids) - 1, 1])
        demoted.append(eng.blocks.num_demoted)
    assert demoted[0] > 0 and demoted[1] == demoted[0]


def test_stats_show_bytes_per_token_and_pool_shares_of_what_is_allocated(tiny_dir):
    off = load(tiny_dir, **ROUTED)
    on = load(tiny_dir, kv_router="int4", **ROUTED)
    ids = on.engine.encode(PROMPT)
    for m in (off, on):
        m.generate_batch([ids], GREEDY)
    s_off, s_on, blocks = off.engine.stats(), on.engine.stats(), on.engine.blocks
    assert s_off["kv_router"] == "off" and "kv_tokens_compressed_share" not in s_off
    full = sum(1 for b in blocks.blocks[:blocks.num_blocks] if b.hash is not None)
    comp = sum(1 for b in blocks.blocks[blocks.num_blocks:] if b.hash is not None)
    assert comp == s_on["kv_blocks_compressed"] > 0 and s_on["kv_host_blocks"] == -(-comp // blocks.per_host)
    assert s_on["kv_tokens_compressed_share"] == pytest.approx(comp / (full + comp), abs=1e-4)
    assert s_on["kv_tokens_full_share"] + s_on["kv_tokens_compressed_share"] == pytest.approx(1)
    assert s_on["kv_bytes_per_token"] < s_off["kv_bytes_per_token"] == s_on["kv_full_precision_bytes_per_token"]
    # the demoted blocks' full-precision space is free again: in use or cached, full blocks and hosts only
    assert s_on["kv_blocks_total"] - s_on["kv_blocks_free"] == 0
    assert len(blocks.free) + blocks.num_host_blocks == blocks.num_blocks


def test_prefix_hit_on_a_compressed_block_is_served_from_the_compressed_copy(tiny_dir):
    m = load(tiny_dir, kv_router="int8", **ROUTED)
    eng = m.engine
    first = eng.encode(PROMPT + "What is os?")
    m.generate_batch([first], GREEDY)
    compressed = {b.hash: b.block_id for b in eng.blocks.blocks if b.hash is not None
                  and eng.blocks.is_compressed(b.block_id)}
    assert compressed
    eng.add_request("again", first, GREEDY)
    eng.step()  # admitted: its table starts with the cached blocks, compressed ones under their old ids
    seq = eng.seqs["again"]
    seen = [b for b in seq.block_table if b in compressed.values()]
    assert seen and seq.num_cached_tokens > 0
    while eng.has_unfinished_requests():
        eng.step()
    for h, block_id in compressed.items():  # the hit ones: same name, same compressed block
        if block_id in seen:  # (others, free, may have lent their slots to the second run's demotions)
            assert eng.blocks.cached.get(h) == block_id
    fresh = load(tiny_dir, kv_router="int8", **ROUTED)  # a second engine replays the same two requests
    fresh.generate_batch([first], GREEDY)
    assert fresh.generate_batch([first], GREEDY)[0].token_ids == m.generate_batch([first], GREEDY)[0].token_ids


def test_cold_tier_keeps_the_full_precision_copy_of_a_demoted_block(tiny_dir, shm):
    """A named block goes to the cold tier at full precision when it is demoted (its hot copy is then
    compressed); once the compressed copy is gone too, a hit comes back from the cold tier
    bit-identical, at full precision, into a fresh block: promotion without loss."""
    kw = dict(ROUTED, kv_block_size=16, recent_tokens=32, router_threshold=0.0)
    m = load(tiny_dir, kv_router="int8", num_kv_blocks=13, cold_tier_mb=8, cold_tier_dir=shm, **kw)
    eng, runner = m.engine, m.engine.runner
    offered = {}
    offer = eng.blocks.on_cached_free

    def keep_a_copy(block):  # what the block holds when it is offered (at demotion: still full precision)
        copy = runner.kv_cache[:, :, block.block_id * 16:(block.block_id + 1) * 16].clone()
        offered.setdefault(block.hash, []).append(copy)
        offer(block)

    eng.blocks.on_cached_free = keep_a_copy
    prompt = eng.encode(PROMPT)[:96]
    m.generate_batch([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
    eng.offloader.drain()
    was_demoted = {b.hash for b in eng.blocks.blocks[eng.blocks.num_blocks:] if b.hash is not None}
    assert was_demoted and was_demoted <= set(offered)
    other = eng.encode("Weather report: rain over the hills, then sun in the afternoon. " * 12)[:170]
    m.generate_batch([other], SamplingParams(max_new_tokens=8, ignore_eos=True))  # needs every block
    eng.offloader.drain()
    assert not was_demoted & set(eng.blocks.cached)  # the compressed copies were dropped with their host
    m.generate_batch([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert eng.stats()["cold_hit_tokens"] > 0
    # the restored blocks were demoted again at the prompt's end: what they held then is what left
    again = [h for h in was_demoted if len(offered[h]) > 1]
    assert again
    for h in again:
        assert torch.equal(offered[h][1], offered[h][0])
    eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_router_on_the_gpu_is_deterministic_and_demotes(tiny_dir, mode):
    runs = []
    for _ in range(2):
        m = O3Model.from_config(O3Config(model_path=tiny_dir, device="cuda", dtype="float32", kv_router=mode,
                                         router_threshold=0.0, **ROUTED))
        ids = [m.engine.encode(PROMPT + f"What is module {i}?") for i in range(3)]
        runs.append([r.token_ids for r in m.generate_batch(ids, GREEDY)])
        assert m.engine.blocks.num_demoted > 0
    assert runs[0] == runs[1]


# ---- the router's decode attention for the CUDA-graph step (Triton; the interpreter on CPU) ------------

def router_meta(rows, max_blocks, scratch_slot, bs):
    """rows: (token, position, full-precision table, compressed table) -> int32 [B, 5 + 2 * max_blocks]."""
    meta = torch.zeros(len(rows), 5 + 2 * max_blocks, dtype=torch.int32)
    for b, (tok, pos, full, comp) in enumerate(rows):
        n_full = pos - len(comp) * bs  # cached full-precision keys before the new token
        slot = full[n_full // bs] * bs + n_full % bs  # the new token goes after them, in the last full block
        meta[b, :5] = torch.tensor([tok, pos, slot, n_full, len(comp)])
        meta[b, 5:5 + len(full)] = torch.tensor(full)
        meta[b, 5 + max_blocks:5 + max_blocks + len(comp)] = torch.tensor(comp, dtype=torch.int32)
    return meta


def router_pools(seed, nblocks, mode, device, dtype, KVH=2, hd=64, bs=8):
    """A seeded layer for the router kernel's tests: full-precision K/V [2, (nblocks + 1) * bs, KVH, hd] (the
    last block the scratch), ten blocks' codes and scales of random vectors (INT4: rotated), the rotation,
    and rotate-half RoPE tables of 256 positions: (kv, rot, codes, scales, cos, sin)."""
    torch.manual_seed(seed)
    kv = (torch.randn(2, (nblocks + 1) * bs, KVH, hd) * 2).to(device, dtype)
    rot = hadamard(hd, device=device) if mode == "int4" else None
    codes, scales = quantize(torch.randn(2, 10 * bs, KVH, hd, device=device) * 2, mode, rot)
    freqs = torch.arange(256)[:, None] / 10000 ** (torch.arange(0, hd, 2) / hd)
    return kv, rot, codes, scales, torch.cat((freqs, freqs), -1).cos().to(device), \
        torch.cat((freqs, freqs), -1).sin().to(device)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # half: the tensor-core path, 64 keys a tile
# codes on the tensor cores, scaled after; INT4 rotated by butterflies; f16: those dots in float16 whatever the cache's
# halves: INT4's codes never interleaved, two dots of half the head dimension (the default; O3EDGE_ROUTER_HALVES=0 off)
@pytest.mark.parametrize("fast", ["0", "1", "f16", "halves"])
def test_router_decode_kernel_matches_dequantize_then_attend(mode, splits, dtype, fast, monkeypatch, device="cpu"):
    from o3edge.engine.kernels.quant_attention import router_decode_attention, router_decode_reference

    monkeypatch.setenv("O3EDGE_ROUTER_FAST", "0" if fast == "0" else "1")
    monkeypatch.setenv("O3EDGE_ROUTER_F16", "0" if fast in ("0", "1") else "1")
    monkeypatch.setenv("O3EDGE_ROUTER_HALVES", "1" if fast == "halves" else "0")

    H, KVH, hd, bs, nblocks, mb = 6, 2, 64, 8, 12, 8
    kv, rot, codes, scales, cos, sin = router_pools(8, nblocks, mode, device, dtype)
    rows = [(1, 37, [0, 3, 5], [2, 7, 9]),  # 13 full keys, then 3 compressed blocks (24 keys)
            (2, 5, [4], []),  # no compressed block
            (3, 40, [6], [0, 1, 3, 4, 5]),  # nothing full before the new token
            (4, 23, [8, 10, 11], [])]
    meta = router_meta(rows, mb, nblocks * bs, bs).to(device)
    qkv = torch.randn(4, (H + 2 * KVH) * hd, device=device).to(dtype)
    k1, v1 = kv[0].clone(), kv[1].clone()
    out = router_decode_attention(qkv, cos, sin, meta, k1, v1, codes, scales, rot, mode, H, bs, splits)
    k2, v2 = kv[0].clone(), kv[1].clone()
    want = router_decode_reference(qkv, cos, sin, meta, k2, v2, codes, scales, rot, mode, H, bs)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), want.float(), **tol)
    # the new keys and values were written (keys through RoPE: the GPU contracts its multiply-adds)
    ktol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k1.float(), k2.float(), **ktol)
    assert torch.equal(v1, v2)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("weights", ["1", "2,3"])
def test_router_decode_kernel_joined_splits_attend_every_key_once(mode, splits, weights, monkeypatch, device="cpu",
                                                                   dtype=torch.float16):
    """O3EDGE_ROUTER_JOINED: a row's key splits share the tiles of both pools in a row (16 full keys, then
    two compressed blocks, a tile here; tiles of equal cost, or a compressed tile 1.5 a full one's), one split
    reading the end of one pool and the start of the other, some splits none: the output still matches
    dequantize-then-attend (a key read twice or left out would move it)."""
    from o3edge.engine.kernels.quant_attention import router_decode_attention, router_decode_reference

    monkeypatch.setenv("O3EDGE_ROUTER_JOINED", weights)
    H, KVH, hd, bs, nblocks, mb = 4, 2, 64, 8, 16, 8
    kv, rot, codes, scales, cos, sin = router_pools(10, nblocks, mode, device, dtype)
    rows = [(1, 61, [0, 3, 5, 11, 14], [2, 7, 9]),  # 37 full keys (3 tiles), 3 compressed blocks (2 tiles)
            (2, 5, [4], []),  # one full tile, nothing compressed
            (3, 40, [6], [0, 1, 3, 4, 5]),  # nothing full before the new token, 3 compressed tiles
            (4, 51, [8, 10, 12, 13, 15, 2], [6])]  # 43 full keys, 1 compressed block
    meta = router_meta(rows, mb, nblocks * bs, bs).to(device)
    qkv = torch.randn(len(rows), (H + 2 * KVH) * hd, device=device).to(dtype)
    out = router_decode_attention(qkv, cos, sin, meta, kv[0].clone(), kv[1].clone(), codes, scales, rot, mode, H,
                                  bs, splits, config=(16, 16, 4, 2))
    want = router_decode_reference(qkv, cos, sin, meta, kv[0].clone(), kv[1].clone(), codes, scales, rot, mode, H,
                                   bs)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mode,fine", [("int8", None), ("int4", None), ("int8", "0")])
def test_router_decode_kernel_in_many_splits_attends_every_key_once(mode, fine, monkeypatch, device="cpu",
                                                                    dtype=torch.float16):
    """A launch in FINE_SPLITS key splits at the planned tiling: INT8 and INT4 take 64-key compressed tiles and
    their splits joined across the pools by default (fine_tiles), 128-key tiles
    and a share of each pool a split with O3EDGE_ROUTER_FINE=0. Rows of a few keys leave most of the 16
    splits nothing to read, one a pool's end and the other's start: the output still matches
    dequantize-then-attend."""
    from o3edge.engine.kernels.quant_attention import (FINE_SPLITS, fine_tiles, router_decode_attention,
                                                       router_decode_reference)

    if fine is not None:
        monkeypatch.setenv("O3EDGE_ROUTER_FINE", fine)
    assert fine_tiles(FINE_SPLITS, False) == (fine != "0")
    assert not fine_tiles(FINE_SPLITS, True)  # observing launches keep their tiling
    H, KVH, hd, bs, nblocks, mb = 4, 2, 64, 8, 24, 12
    kv, rot, codes, scales, cos, sin = router_pools(10, nblocks, mode, device, dtype)
    rows = [(1, 120, [0, 3, 5, 11, 13, 15], list(range(10))),  # 40 full keys; 10 compressed blocks: two tiles
            (2, 5, [4], []),  # a few full keys, nothing compressed
            (3, 40, [6, 7], [0, 1, 8, 9]),  # 8 full keys before the new token, one compressed tile
            (4, 100, [12, 14, 16, 18, 20, 22, 1, 2, 8, 9, 10, 17], [6])]  # 92 full keys (two tiles), one block
    meta = router_meta(rows, mb, nblocks * bs, bs).to(device)
    qkv = torch.randn(len(rows), (H + 2 * KVH) * hd, device=device).to(dtype)
    out = router_decode_attention(qkv, cos, sin, meta, kv[0].clone(), kv[1].clone(), codes, scales, rot, mode, H,
                                  bs, FINE_SPLITS)
    want = router_decode_reference(qkv, cos, sin, meta, kv[0].clone(), kv[1].clone(), codes, scales, rot, mode, H,
                                   bs)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,fine", [("int8", None), ("int4", None), ("int8", "0")])
def test_router_decode_kernel_in_many_splits_on_the_gpu(mode, fine, monkeypatch):
    test_router_decode_kernel_in_many_splits_attends_every_key_once(mode, fine, monkeypatch, device="cuda",
                                                                    dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("weights", ["1", "2,3"])
def test_router_decode_kernel_joined_splits_on_the_gpu(mode, splits, weights, monkeypatch):
    test_router_decode_kernel_joined_splits_attend_every_key_once(mode, splits, weights, monkeypatch, device="cuda",
                                                                  dtype=torch.bfloat16)


@pytest.mark.parametrize("variant", ["first", "fast", "halves"])  # O3EDGE_ROUTER_FAST=0, the default, and halves
def test_router_decode_kernel_takes_a_large_query_into_float16_range(variant, monkeypatch, device="cpu",
                                                                      dtype=torch.float16):
    """The compressed pool's float16 dots see the query scaled by a power of two into float16's range: an
    INT4 query rotated by the Hadamard matrix grows up to sqrt(hd) times, here past 65,504 (inf in float16,
    and NaN in the output, without the scaling), and the output still matches dequantize-then-attend."""
    from o3edge.engine.kernels.quant_attention import router_decode_attention, router_decode_reference
    from o3edge.engine.rope import apply_rope

    monkeypatch.setenv("O3EDGE_ROUTER_FAST", "0" if variant == "first" else "1")
    monkeypatch.setenv("O3EDGE_ROUTER_HALVES", "1" if variant == "halves" else "0")
    torch.manual_seed(9)
    H, KVH, hd, bs, nblocks, mb = 2, 1, 64, 8, 4, 4
    kv = (torch.randn(2, (nblocks + 1) * bs, KVH, hd) * 2).to(device, dtype)
    rot = hadamard(hd, device=device)
    codes, scales = quantize(torch.randn(2, 4 * bs, KVH, hd, device=device) * 2, "int4", rot)
    freqs = torch.zeros(64, hd // 2)  # RoPE at angle 0: the query stays as it is
    cos, sin = torch.cat((freqs, freqs), -1).cos().to(device), torch.cat((freqs, freqs), -1).sin().to(device)
    meta = router_meta([(1, 29, [0], [1, 2, 3])], mb, nblocks * bs, bs).to(device)  # 5 full keys, 24 compressed
    qkv = torch.randn(1, (H + 2 * KVH) * hd, device=device)
    qkv[0, :H * hd] = 2e4  # every query coordinate 20,000: rotated, 160,000 in one of them
    qkv = qkv.to(dtype)
    q = apply_rope(qkv[:, :H * hd].view(1, H, hd).float(), cos[29:30], sin[29:30])
    assert (q @ rot).abs().max() > 65504
    out = router_decode_attention(qkv, cos, sin, meta, kv[0].clone(), kv[1].clone(), codes, scales, rot, "int4", H,
                                  bs, 1)
    want = router_decode_reference(qkv, cos, sin, meta, kv[0].clone(), kv[1].clone(), codes, scales, rot, "int4",
                                   H, bs)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fast", ["0", "1", "f16", "halves"])
def test_router_decode_kernel_on_the_gpu(mode, splits, dtype, fast, monkeypatch):
    test_router_decode_kernel_matches_dequantize_then_attend(mode, splits, dtype, fast, monkeypatch, device="cuda")


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 3])
def test_router_decode_kernel_observes_the_probabilities_it_attends_with(mode, dtype, splits, device="cpu"):
    """Saliency observed inside the step (for the CUDA graph): every key's attention probability,
    averaged over the heads, at its place in the mass rows, and over two layers they add up; in one key
    split (a second pass over the keys) and in three (scores stored, observed after the splits)."""
    from o3edge.engine.kernels.quant_attention import router_decode_attention, router_decode_reference

    H, KVH, hd, bs, nblocks, mb = 6, 2, 64, 8, 12, 8
    kv, rot, codes, scales, cos, sin = router_pools(9, nblocks, mode, device, dtype)
    rows = [(1, 37, [0, 3, 5], [2, 7, 9]), (2, 5, [4], []), (3, 40, [6], [0, 1, 3, 4, 5])]
    meta = router_meta(rows, mb, nblocks * bs, bs).to(device)
    P = mb * bs
    mass = torch.zeros(3, KVH, 2, P, device=device)
    want = torch.zeros(3, 2, P, device=device)
    for _ in range(2):  # two layers' worth (the same inputs): the rows accumulate
        qkv = torch.randn(3, (H + 2 * KVH) * hd, device=device).to(dtype)
        k1, v1 = kv[0].clone(), kv[1].clone()
        out = router_decode_attention(qkv, cos, sin, meta, k1, v1, codes, scales, rot, mode, H, bs, splits,
                                      mass=mass)
        k2, v2 = kv[0].clone(), kv[1].clone()
        ref = router_decode_reference(qkv, cos, sin, meta, k2, v2, codes, scales, rot, mode, H, bs, mass=want)
    exact = dtype == torch.float32
    torch.testing.assert_close(out.float(), ref.float(), **(dict(atol=2e-5, rtol=1e-4) if exact else
                                                            dict(atol=2e-2, rtol=2e-2)))
    got = mass.sum(1)  # probabilities: half-precision scores move them by ~1e-3 (bf16: a few)
    torch.testing.assert_close(got, want, **(dict(atol=2e-5, rtol=1e-4) if exact else
                                             dict(atol=2e-3 if dtype == torch.float16 else 6e-3, rtol=5e-2)))
    for b, (_, pos, _, comp) in enumerate(rows):  # each observing layer's probabilities sum to one a row
        # (float16 on the H200: 1.27e-3 off over two layers' ~100 probabilities, each within 2e-3 above)
        assert abs(float(got[b].sum()) - 2.0) < (1e-3 if exact else 2e-3)
        n_full = pos - len(comp) * bs
        assert float(got[b, 0, n_full + 1:].abs().sum()) == 0 and float(got[b, 1, len(comp) * bs:].abs().sum()) == 0


def test_observing_into_a_wrong_mass_is_refused():
    """The observation's rows must be [B, KVH, 2, P] and contiguous: anything else is refused, not
    written wrongly."""
    from o3edge.engine.kernels.quant_attention import router_decode_attention

    H, KVH, hd, bs, mb = 4, 2, 64, 8, 4
    codes, scales = quantize(torch.zeros(2, 4 * bs, KVH, hd), "int8")
    cache = torch.zeros(8 * bs, KVH, hd)
    meta = router_meta([(1, 9, [0, 1], [])], mb, 8 * bs, bs)
    with pytest.raises(ValueError, match="contiguous"):
        router_decode_attention(torch.zeros(1, (H + 2 * KVH) * hd), torch.ones(64, hd), torch.zeros(64, hd), meta,
                                cache, cache.clone(), codes, scales, None, "int8", H, bs, 3,
                                mass=torch.zeros(1, 2, KVH, mb * bs).transpose(1, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_router_decode_kernel_observes_on_the_gpu(mode, dtype, splits):
    test_router_decode_kernel_observes_the_probabilities_it_attends_with(mode, dtype, splits, device="cuda")


