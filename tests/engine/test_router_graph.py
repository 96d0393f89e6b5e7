"""The token router's decode step on the CUDA-graph path (router_graph.py): the same step as the eager
router's, both pools inside one static-shape forward. On CPU it runs uncaptured through Triton's
interpreter; on a GPU it is captured and replayed."""

import pytest
import torch

from o3edge import O3Config, O3Model
from o3edge.engine.router_graph import RouterDecodeGraphs
from o3edge.engine.sequence import SamplingParams, Sequence

PROMPT = "You are a careful assistant who answers questions about the Python standard library. " * 3
ROUTED = dict(kv_block_size=8, sink_tokens=4, recent_tokens=16, router_refresh_steps=4, router_threshold=0.0)


def advance(eng, batch, tokens):
    """What the engine does after a step: mark its tokens computed, append the sampled ones; the next
    batch (every sequence decoding)."""
    for (seq, n), tok in zip(batch, tokens):
        eng.blocks.mark_computed(seq, n)
        seq.token_ids.append(tok)
        eng.blocks.append_slot(seq)
    return [(seq, 1) for seq, _ in batch]


def run_to_end(eng, arrivals: dict | None = None) -> tuple[dict, list[int]]:
    """Step eng until every request is done: (tokens by request id, blocks demoted so far after each step);
    arrivals: steps taken -> (request id, prompt ids, params) added before the next one."""
    out, demoted = {}, []
    while eng.has_unfinished_requests():
        if arrivals and len(demoted) in arrivals:
            eng.add_request(*arrivals[len(demoted)])
        for o in eng.step()[0]:
            out.setdefault(o.request_id, []).extend(o.token_ids)
        demoted.append(eng.blocks.num_demoted)
    return out, demoted


def two_prompts(tiny_dir, mode: str):
    """(engine, runner, uncaptured router graphs, two sequences holding their prompts' blocks)."""
    m = O3Model.from_config(O3Config(model_path=tiny_dir, device="cpu", kv_router=mode, **ROUTED))
    eng, runner = m.engine, m.engine.runner
    seqs = [Sequence(str(i), eng.encode(PROMPT + f"Module {i}?"), SamplingParams(max_new_tokens=64))
            for i in range(2)]
    for seq in seqs:
        eng.blocks.allocate(seq, reuse=False)
    return eng, runner, RouterDecodeGraphs(runner, 2, capture=False), seqs


def test_graph_step_equals_the_eager_router_step(tiny_dir, mode="int4"):  # int4: the rotations too
    eng, runner, graphs, seqs = two_prompts(tiny_dir, mode)
    batch, compared = [(s, len(s)) for s in seqs], 0
    for _ in range(10):
        if not runner.router.needs_eager(batch) and not runner.router.observing_now():
            logits, _ = graphs.run(batch)  # writes the same K/V the eager step writes again
            graph_logits = logits.clone()
            tokens = runner.run(batch)
            torch.testing.assert_close(graph_logits, runner.last_logits, atol=1e-4, rtol=1e-4)
            compared += 1
        else:
            tokens = runner.run(batch)
        batch = advance(eng, batch, tokens)
    assert compared >= 5
    assert all(any(eng.blocks.is_compressed(b) for b in s.block_table) for s in seqs)  # both pools were read


@pytest.mark.parametrize("mode, observe_splits", [("int8", "0"), ("int4", "0"), ("int8", "1")])
def test_graph_refresh_step_observes_what_the_eager_step_observes(tiny_dir, mode, observe_splits, monkeypatch):
    """A refresh step on the graph path (its observing variant) adds the same attention mass and
    observer counts to every sequence's books as the eager step does, and gives the same logits, though
    the bucket's ordinary steps run in 3 key splits: observing in one split, or (O3EDGE_ROUTER_OBSERVE_SPLITS=1)
    in the bucket's 3, its scores stored and observed after them."""
    monkeypatch.setenv("O3EDGE_ROUTER_OBSERVE_SPLITS", observe_splits)
    routed = {**ROUTED, "router_threshold": 0.5, "router_refresh_steps": 2}
    m = O3Model.from_config(O3Config(model_path=tiny_dir, device="cpu", kv_router=mode, **routed))
    eng, runner = m.engine, m.engine.runner
    router, graphs = runner.router, RouterDecodeGraphs(runner, 2, capture=False)
    graphs.splits = {b: 3 for b in graphs.splits}
    seqs = [Sequence(str(i), eng.encode(PROMPT + f"Module {i}?"), SamplingParams(max_new_tokens=64))
            for i in range(2)]
    for seq in seqs:
        eng.blocks.allocate(seq, reuse=False)
    batch, compared, with_compressed = [(s, len(s)) for s in seqs], 0, False
    for _ in range(12):
        if not router.needs_eager(batch) and router.observing_now():
            books = router.books
            rows = [books.rows[s.seq_id] for s in seqs]
            ctx = [s.num_computed_tokens + 1 for s in seqs]  # the new token's place too
            before = [(books.mass[r, :n].clone(), books.count[r, :n].clone()) for r, n in zip(rows, ctx)]
            logits, _ = graphs.run(batch)
            graph_logits = logits.clone()
            mid = [(books.mass[r, :n].clone(), books.count[r, :n].clone()) for r, n in zip(rows, ctx)]
            tokens = runner.run(batch)  # the eager refresh step observes (and routes) again
            torch.testing.assert_close(graph_logits, runner.last_logits, atol=1e-4, rtol=1e-4)
            for r, n, (m0, c0), (m1, c1) in zip(rows, ctx, before, mid):
                torch.testing.assert_close(m1 - m0, books.mass[r, :n] - m1, atol=1e-6, rtol=1e-4)
                assert torch.equal(c1 - c0, books.count[r, :n] - c1) and float((c1 - c0).min()) == 1.0
                assert float((m1 - m0).sum()) > 0
                assert float(books.count[r, n:].abs().sum()) == 0  # nobody observed past the new token
            with_compressed |= any(eng.blocks.is_compressed(b) for s in seqs for b in s.block_table)
            compared += 1
        else:
            tokens = runner.run(batch)
        batch = advance(eng, batch, tokens)
    assert compared >= 4 and with_compressed  # both pools were observed


@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_refresh_routed_in_one_graph_demotes_what_the_operations_one_by_one_do(tiny_dir, device, fused,
                                                                                  monkeypatch):
    """A refresh step's books and saliency read run as one graph a bucket (_observe_and_route) instead of
    observed_in_graph and prepare_routing launched one by one: the same blocks are demoted at the same
    steps, so the same tokens come out, and sequences that end between refreshes change nothing. (On CUDA:
    the engine's captured graphs, the route graphs replayed; each key's place in the books takes one addition
    a refresh, so the books are the same bits either way.) O3EDGE_ROUTER_FUSED_ROUTE=0: the route graph runs
    the operations instead of kernels/route.py's kernels (the default)."""
    monkeypatch.setenv("O3EDGE_ROUTER_FUSED_ROUTE", fused)
    routed = {**ROUTED, "router_threshold": 0.5, "router_refresh_steps": 3}
    if device == "cuda":
        routed.update(dtype="float32", router_cuda_graphs=True)
    runs = []
    for routes in (False, True):
        m = O3Model.from_config(O3Config(model_path=tiny_dir, device=device, kv_router="int8", **routed))
        runner = m.engine.runner
        if device == "cpu":
            runner.graphs = RouterDecodeGraphs(runner, 4, capture=False)
        assert runner.graphs.routes  # (made so: a refresh routed in one graph is the default)
        runner.graphs.routes = routes
        demoted = []
        m.engine.blocks.demote_all = _counting(m.engine.blocks.demote_all, demoted)
        outs = {}
        for i, n in enumerate((16, 8, 13)):  # sequences end between refreshes and at one
            m.engine.add_request(str(i), m.engine.encode(PROMPT + f"What is module {i}?"),
                                 SamplingParams(max_new_tokens=n, ignore_eos=True))
        while m.engine.has_unfinished_requests():
            for out in m.engine.step()[0]:
                outs.setdefault(out.request_id, []).extend(out.token_ids)
        runs.append((outs, demoted, runner.graphs.num_routes))
    (outs0, demoted0, routes0), (outs1, demoted1, routes1) = runs
    assert routes0 == 0 and routes1 >= 3  # the second run routed its refreshes in the graph
    assert outs0 == outs1 and demoted0 == demoted1 and len(demoted1) > 0


def _counting(demote_all, log):
    """demote_all, logging (request, table index, tokens computed) of each block it moved."""
    def wrapper(seq, indices):
        before = list(seq.block_table)
        moved = demote_all(seq, indices)
        log.extend((seq.request_id, i, seq.num_computed_tokens) for i in indices if seq.block_table[i] != before[i])
        return moved
    return wrapper


def test_steps_launched_ahead_give_the_same_tokens_refresh_steps_included(tiny_dir):
    """With launch ahead, the graph path queues step n+1 while the host finishes step n, observing
    refresh steps and the steps that carry out their demotions included (those are done before the next
    step is queued): the tokens are those of the same path without it, blocks are demoted on the way,
    and every decode step but the first was taken from the queue."""
    routed = {**ROUTED, "router_threshold": 0.5, "router_refresh_steps": 4}
    outs = []
    for ahead in (False, True):
        m = O3Model.from_config(O3Config(model_path=tiny_dir, device="cpu", kv_router="int8", **routed))
        runner = m.engine.runner
        runner.graphs = RouterDecodeGraphs(runner, 4, capture=False, launch_ahead=ahead)
        ids = [m.engine.encode(PROMPT + f"What is module {i}?") for i in range(3)]
        outs.append([r.token_ids for r in m.generate_batch(ids, SamplingParams(max_new_tokens=11, ignore_eos=True))])
        assert m.engine.blocks.num_demoted > 0 and runner.graphs.num_steps >= 10
        taken, steps = runner.graphs.num_ahead_taken, runner.graphs.num_steps
        print(f"launch ahead {ahead}: {taken} of {steps} graph steps taken from the queue")
        # not taken: the first decode step (before refresh steps were queued, every refresh step and the
        # one after it missed; before demotions were carried out ahead, the step after each of those)
        assert (taken == steps - 1) if ahead else taken == 0
    assert outs[0] == outs[1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_prompt_arriving_while_others_decode_leaves_their_rows_on_the_graph_step(tiny_dir, device):
    """A request arriving mid-generation, its prompt prefilled in chunks: each step with a prompt chunk and
    decoding sequences runs the chunk eager and the decoding rows on the graph step (before, the whole step
    ran eager). The tokens and the demotions after every step are the eager path's, and every decode step
    of the requests already running was a graph step, refresh steps included. (On CUDA: captured graphs.)"""
    routed = {**ROUTED, "router_refresh_steps": 4, "max_num_batched_tokens": 24}  # threshold 0: demotions sure
    outs, timelines = [], []
    for graphs in (False, True):
        m = O3Model.from_config(O3Config(model_path=tiny_dir, device=device, dtype="float32", kv_router="int8",
                                         router_cuda_graphs=graphs and device == "cuda", **routed))
        eng, runner = m.engine, m.engine.runner
        if graphs and device == "cpu":
            runner.graphs = RouterDecodeGraphs(runner, 4, capture=False, launch_ahead=True)
        for i in range(2):
            eng.add_request(str(i), eng.encode(PROMPT + f"Module {i}?"), SamplingParams(max_new_tokens=24,
                                                                                         ignore_eos=True))
        mixed, split = [], runner._run_router_split
        runner._run_router_split = lambda *args: mixed.append(1) or split(*args)
        late = ("late", eng.encode("Late. " + PROMPT), SamplingParams(max_new_tokens=6, ignore_eos=True))
        # it arrives once both decode (their prompts: 24 tokens a step); it shares no prefix with them
        out, demoted = run_to_end(eng, {8: late})
        outs.append(out)
        timelines.append(demoted)
        if graphs:
            assert len(mixed) >= 4  # the late prompt took its chunks beside the two decoding requests
            assert runner.graphs.num_steps >= 23  # every decode step of the first two (24 tokens each)
    assert outs[0] == outs[1] and timelines[0] == timelines[1]
    assert timelines[0][-1] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode, observe_splits", [("int8", "0"), ("int4", "0"), ("int8", "1")])
def test_router_decode_in_cuda_graphs_matches_eager(tiny_dir, mode, observe_splits, monkeypatch):
    """Captured router graphs (refresh steps observing in one key split, or with
    O3EDGE_ROUTER_OBSERVE_SPLITS=1 in the bucket's) give the eager router's tokens, demotions on the way."""
    monkeypatch.setenv("O3EDGE_ROUTER_OBSERVE_SPLITS", observe_splits)
    outs = []
    for graphs in (False, True):
        m = O3Model.from_config(O3Config(model_path=tiny_dir, device="cuda", dtype="float32", kv_router=mode,
                                         router_cuda_graphs=graphs, **ROUTED))
        ids = [m.engine.encode(PROMPT + f"What is module {i}?") for i in range(3)]
        outs.append([r.token_ids for r in m.generate_batch(ids, SamplingParams(max_new_tokens=40, ignore_eos=True))])
        runner = m.engine.runner
        assert (runner.graphs is not None and runner.graphs.num_steps > 20) == graphs
        assert m.engine.blocks.num_demoted > 0
    assert outs[0] == outs[1]


def test_step_metadata_follows_the_block_tables_it_was_made_from(tiny_dir):
    """A sequence's metadata row is made again when its table changes (fill_meta keeps the rows of
    unchanged tables): after a demotion and after a new block, the row holds the tables as they are
    then, full-precision blocks in one table and compressed ones in the other."""
    import numpy as np

    eng, runner, graphs, seqs = two_prompts(tiny_dir, "int8")
    for seq in seqs:
        seq.num_computed_tokens = len(seq) - 1
    batch, nf, mb, bs = [(s, 1) for s in seqs], runner.router.num_full_blocks, graphs.max_blocks, graphs.block_size

    def expected_rows():
        meta = np.zeros((2, graphs.meta_columns()), dtype=np.int32)
        for b, (seq, _) in enumerate(batch):
            table = seq.block_table[:seq.num_computed_tokens // bs + 1]
            full, comp = [x for x in table if x < nf], [x - nf for x in table if x >= nf]
            meta[b, 3:5] = seq.num_computed_tokens - len(comp) * bs, len(comp)
            meta[b, 5:5 + len(full)], meta[b, 5 + mb:5 + mb + len(comp)] = full, comp
        return meta[:, 3:]

    def rows():
        meta = np.zeros((2, graphs.meta_columns()), dtype=np.int32)
        graphs.fill_meta(meta, batch, 2, 0)
        return meta[:, 3:]

    np.testing.assert_array_equal(rows(), expected_rows())
    eng.blocks.demoter = runner.router
    assert eng.blocks.demote(seqs[0], 1)  # block 1 of the first sequence moves to the compressed pool
    runner.router.flush_moves()
    np.testing.assert_array_equal(rows(), expected_rows())
    assert rows()[0, 1] == 1  # one compressed block
    blocks = len(seqs[1].block_table)
    while len(seqs[1].block_table) == blocks:  # the second sequence decodes into a new block
        seqs[1].token_ids.append(1)
        seqs[1].num_computed_tokens += 1
        eng.blocks.append_slot(seqs[1])
    np.testing.assert_array_equal(rows(), expected_rows())
    assert rows()[1, 2 + len(seqs[1].block_table) - 1] == seqs[1].block_table[-1]  # the new block, in the row


def test_step_metadata_of_a_table_grown_by_blocks_of_either_pool(tiny_dir):
    """A row whose sequence's table only grew since its last step is extended rather than made again
    (fill_meta): the same row as one made whole, in either host buffer, whichever pool the new blocks are in,
    launched now or ahead, and the same table entries for an observing step's split."""
    import numpy as np

    eng, runner, graphs, seqs = two_prompts(tiny_dir, "int8")
    whole = RouterDecodeGraphs(runner, 2, capture=False)  # its rows made whole every time
    nf, bs, seq = runner.router.num_full_blocks, graphs.block_size, seqs[0]
    batch = [(seq, 1)]
    seq.num_computed_tokens = len(seq.block_table) * bs - 1  # the last position of its last block
    seq.token_ids += [1] * (6 * bs)

    def rows(ahead: int, parity: int) -> tuple:
        meta, whole.memo = graphs.meta_host[parity].numpy(), {}
        graphs.fill_meta(meta, batch, 1, ahead, parity)
        expected = np.zeros((1, whole.meta_columns()), dtype=np.int32)
        whole.fill_meta(expected, batch, 1, ahead)
        k = (seq.num_computed_tokens + ahead) // bs + 1
        return meta[:1], expected, graphs.memo[seq.seq_id][3][2], seq.block_table[:k]

    for step, block_id in enumerate([3, nf + 5, 4, nf + 2, nf + 7]):  # new blocks: full precision or compressed
        seq.block_table.append(block_id)
        # queued into the new block (extending the row of the step before), every other step then launched now
        for ahead, parity in [(1, step % 2)] + ([(0, 1 - step % 2)] if step % 2 else []):
            got, expected, entries, table = rows(ahead, parity)
            np.testing.assert_array_equal(got, expected)
            np.testing.assert_array_equal(entries, table)
        seq.num_computed_tokens += bs


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_router_key_splits_never_take_more_than_one_wave(mode):
    """The two-pool kernel's key splits fill at most the programs an SM holds at once (router_graph.py),
    where full precision's aim for eight a SM; one split once the batch alone fills the SMs."""
    from o3edge.engine.cuda_graph import DecodeGraphs, attention_splits
    from o3edge.engine.router_graph import router_attention_per_sm

    per_sm, sms = router_attention_per_sm(mode), 132
    for batch, kv_heads in [(1, 8), (4, 2), (16, 2), (16, 8), (8, 4), (64, 8), (3, 5)]:
        splits = attention_splits(batch, kv_heads, sms, per_sm, one_wave=True)
        programs = batch * kv_heads
        assert splits >= 1 and (splits == 1 or splits * programs <= per_sm * sms)
        assert programs >= sms or (splits + 1) * programs > per_sm * sms or splits == 32  # no fewer than fit
        full = attention_splits(batch, kv_heads, sms, DecodeGraphs.ATTENTION_PER_SM)
        assert full == 1 or full * programs >= DecodeGraphs.ATTENTION_PER_SM * sms or full == 32
    # llama-1b and the reference model at 16 sequences, as measured on the H200
    assert attention_splits(16, 8, sms, per_sm, one_wave=True) == 4
    assert attention_splits(16, 2, sms, per_sm, one_wave=True) == 16


@pytest.mark.parametrize("spread", [1, 3])
def test_a_refresh_demotions_are_carried_out_alike_on_both_paths(tiny_dir, monkeypatch, spread):
    """A decode refresh's demotions are carried out in one step (by default) or, with
    O3EDGE_ROUTER_DEMOTION_STEPS=3, over 3 steps, a share a step; the eager path and the graph path
    (steps launched ahead) carry out the same ones in the same steps: the same tokens and the same
    demotions after every step."""
    monkeypatch.setenv("O3EDGE_ROUTER_DEMOTION_STEPS", str(spread))  # a measurement switch (default 1)
    routed = {**ROUTED, "router_refresh_steps": 8}  # threshold 0: every block sealed since is demoted
    timelines, outs = [], []
    for graphs in (False, True):
        m = O3Model.from_config(O3Config(model_path=tiny_dir, device="cpu", kv_router="int8", **routed))
        eng, runner = m.engine, m.engine.runner
        assert runner.router.cfg.demotion_steps == spread
        if graphs:
            runner.graphs = RouterDecodeGraphs(runner, 4, capture=False, launch_ahead=True)
        for i in range(3):
            eng.add_request(str(i), eng.encode(PROMPT + f"What is module {i}?"),
                            SamplingParams(max_new_tokens=40, ignore_eos=True))
        out, demoted = run_to_end(eng)
        timelines.append(demoted)
        outs.append(out)
        if graphs:
            assert runner.graphs.num_ahead_taken >= 30
    assert outs[0] == outs[1] and timelines[0] == timelines[1]
    start = next(i for i, d in enumerate(timelines[0]) if d > 0)  # the prompts' routing: all at once
    per_step = [b - a for a, b in zip(timelines[0][start:], timelines[0][start + 1:])]
    # each refresh (every 8 steps) demotes the block each of the 3 sequences sealed since: all 3 in one
    # step, or one a step
    assert sum(per_step) >= 9 and max(per_step) == 3 // spread
