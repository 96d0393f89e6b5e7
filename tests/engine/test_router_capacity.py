"""The token router frees memory: a demoted block's full-precision space goes back to the pool, so the
same KV budget holds more tokens at once."""

import pytest
import torch
import torch.nn.functional as F

from o3edge import O3Config, O3Model
from o3edge.engine.kv_quant import dequantize, quantize
from o3edge.engine.router import KVRouter, RouterConfig
from o3edge.engine.router_blocks import RouterBlocks
from o3edge.engine.sequence import SamplingParams, Sequence

KL_BOUND = {"int8": 0.005, "int4": 0.02}  # the mean KL bounds, nats
WORDS = "alpha beta gamma delta epsilon zeta theta iota kappa lambda sigma omega".split()


def books(num_blocks=6, bs=4, mode="int8"):
    """A real RouterBlocks over a real KVRouter on a small random float32 pool."""
    torch.manual_seed(0)
    kv = torch.randn(2, 2, (num_blocks + 1) * bs, 2, 16)
    router = KVRouter(RouterConfig(mode), kv, num_blocks, bs, 1)
    blocks = RouterBlocks(num_blocks, bs, "model", True, router.per_host)
    blocks.demoter = router
    return blocks, router, kv


def test_demotion_frees_full_precision_blocks_and_a_free_host_goes_back():
    blocks, router, kv = books()
    seq = Sequence("a", list(range(20)), SamplingParams())
    blocks.allocate(seq)
    blocks.mark_computed(seq, 20)
    assert blocks.num_free_blocks == 1 and router.per_host == 4
    b1, b2 = seq.block_table[1], seq.block_table[2]
    want = [kv[:, :, b * 4:(b + 1) * 4].clone() for b in (b1, b2)]
    h1 = blocks.blocks[b1].hash

    assert blocks.demote(seq, 1)  # no free compressed slot: the block's own bytes host it
    assert blocks.is_compressed(seq.block_table[1]) and blocks.num_host_blocks == 1
    assert blocks.num_free_blocks == 1 and b1 not in blocks.free
    assert blocks.cached[h1] == seq.block_table[1] and blocks.blocks[seq.block_table[1]].hash == h1
    assert blocks.demote(seq, 2)  # packed into the host's next slot: block b2 is free again
    assert blocks.num_free_blocks == 2 and next(iter(blocks.free)) == b2
    assert not blocks.demote(seq, 2)  # compressed already
    router.flush_moves()  # both blocks' data in one go: b1 read before its own bytes take the codes
    for i, w in zip((1, 2), want):  # the codes in the host's bytes stand for what the blocks held
        c = seq.block_table[i] - blocks.num_blocks
        back = dequantize(router.codes[:, :, c * 4:(c + 1) * 4], router.scales[:, :, c * 4:(c + 1) * 4], "int8")
        torch.testing.assert_close(back, w, atol=w.abs().amax().item() / 100, rtol=0)

    blocks.free_seq(seq)  # the compressed blocks stay cached; their host is free to reclaim
    assert blocks.num_free_blocks == 6 and h1 in blocks.cached
    big = Sequence("b", list(range(100, 124)), SamplingParams())
    assert blocks.can_allocate(big)
    blocks.allocate(big)  # every block: the host is reclaimed, its compressed blocks' names dropped
    assert blocks.num_free_blocks == 0 and blocks.num_host_blocks == 0 and h1 not in blocks.cached
    assert sorted(big.block_table) == list(range(6))


def test_a_large_flush_goes_a_few_layers_at_a_time_and_reads_every_source_first():
    """24 blocks of a pool whose layers are ~6 MB each in the flush (more than its 4 MB chunk): on the CPU
    a layer at a time. Blocks 0-5 host their own codes and three others' (queued before their own move):
    every block's codes are those of its original K/V."""
    torch.manual_seed(2)
    L, bs, H, D, nblocks = 3, 32, 8, 128, 30
    kv = torch.randn(L, 2, (nblocks + 1) * bs, H, D)
    original = kv.clone()
    router = KVRouter(RouterConfig("int8"), kv, nblocks, bs, 1)
    assert router.per_host == 4 and not router.move_kernel  # the torch path, as on every CPU engine
    moves = [(k, (k // 4) * 4 + k % 4) for k in range(24)]
    for source, comp in sorted(moves, key=lambda m: m[0] % 4 == 0):  # hosts' own moves last
        router.move([(source, comp)])
    router.flush_moves()
    for source, comp in moves:
        want_codes, want_scales = quantize(original[:, :, source * bs:(source + 1) * bs], "int8")
        assert torch.equal(router.codes[:, :, comp * bs:(comp + 1) * bs], want_codes)
        assert torch.equal(router.scales[:, :, comp * bs:(comp + 1) * bs], want_scales)
    assert torch.equal(kv[:, :, 6 * bs:], original[:, :, 6 * bs:])  # the hosts' bytes only were written


def test_a_shared_block_is_not_demoted_and_a_hit_revives_a_compressed_one():
    blocks, router, _ = books(num_blocks=8)
    a = Sequence("a", list(range(13)), SamplingParams())
    blocks.allocate(a)
    blocks.mark_computed(a, 13)
    assert blocks.demote(a, 0)
    comp = a.block_table[0]
    b = Sequence("b", list(range(13)), SamplingParams())  # the same prefix: hits blocks 0..2
    assert blocks.can_allocate(b)
    blocks.allocate(b)
    assert b.block_table[0] == comp and b.num_cached_tokens == 12
    assert not blocks.demote(b, 1)  # two holders
    blocks.free_seq(a)
    blocks.free_seq(b)
    c = Sequence("c", list(range(13)), SamplingParams())
    free = blocks.num_free_blocks
    assert blocks.can_allocate(c)
    blocks.allocate(c)  # two full hits and one new block, and the compressed hit keeps its host taken
    assert c.block_table[0] == comp and blocks.num_free_blocks == free - 4


def run(tiny_dir, mode: str, budget: int):
    """Eight distinct 120-token prompts at once; per request: its tokens and the logits they came from."""
    m = O3Model.from_config(O3Config(model_path=tiny_dir, device="cpu", kv_router=mode, kv_block_size=8,
                                     num_kv_blocks=budget, max_num_seqs=8, sink_tokens=4, recent_tokens=16,
                                     router_threshold=0.0, router_refresh_steps=4))
    eng, runner = m.engine, m.engine.runner
    logits: dict[str, list[torch.Tensor]] = {}
    step_run = runner.run

    def keep_logits(batch):  # the real step; what it computed is kept for the comparison
        tokens = step_run(batch)
        for (seq, _), row, tok in zip(batch, runner.last_logits, tokens):
            if tok is not None:
                logits.setdefault(seq.request_id, []).append(row.clone())
        return tokens

    runner.run = keep_logits
    for i in range(8):
        text = " ".join(WORDS[(i * 7 + j * j) % 12] + str(i * 100 + j) for j in range(40))
        eng.add_request(str(i), eng.encode(text)[:120], SamplingParams(max_new_tokens=24, ignore_eos=True))
    peak, outs = 0, {}
    while eng.has_unfinished_requests():
        for out in eng.step()[0]:
            outs.setdefault(out.request_id, []).extend(out.token_ids)
        peak = max(peak, len(eng.scheduler.running))
    return peak, eng.stats()["preemptions"], outs, logits


@pytest.fixture(scope="module")
def without_router(tiny_dir):
    return run(tiny_dir, "off", 64)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_same_kv_budget_runs_more_sequences_at_once_with_the_router(tiny_dir, without_router, mode):
    """64 blocks of 8 tokens: without the router four 144-token sequences fit at a time and two are
    preempted; with it (its compressed pool's scales taken out of the same 64 blocks' bytes) the
    demoted prompts give their space back: more run at once, none preempted, outputs within bounds."""
    peak_off, pre_off, outs_off, logits_off = without_router
    peak_on, pre_on, outs_on, logits_on = run(tiny_dir, mode, 64)
    assert peak_off == 4 and pre_off > 0
    assert peak_on >= 6 and pre_on == 0
    kls, same = [], 0
    for rid, toks in outs_off.items():
        assert len(outs_on[rid]) == len(toks) == 24
        for i, (x, y) in enumerate(zip(toks, outs_on[rid])):
            p, q = F.log_softmax(logits_off[rid][i], -1), F.log_softmax(logits_on[rid][i], -1)
            kls.append(float((p.exp() * (p - q)).sum()))
            if x != y:
                break  # past a different token the contexts differ
            same += 1
    print(mode, peak_off, pre_off, peak_on, pre_on, sum(kls) / len(kls), max(kls), same)
    assert sum(kls) / len(kls) <= KL_BOUND[mode]
    assert same >= 0.98 * 8 * 24
