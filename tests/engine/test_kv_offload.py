"""The engine with a cold tier: offload, cold hits, restarts in another process, refusals, swaps on preemption."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from o3edge import O3Config, O3Model
from o3edge.engine import cold_tier as ct
from o3edge.engine.kv_offload import KVOffloader, _runs, by_slot
from o3edge.engine.sequence import SamplingParams

SYSTEM = "You are a careful assistant who answers questions about the Python standard library. " * 4
OTHER = "Weather report: rain over the hills, then sun in the afternoon and a cold night ahead. " * 4
THIRD = "Shipping notice: the parcel left the depot this morning and arrives on Friday by noon. " * 4
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # pytest -m gpu runs the CUDA copies


def load(path, device="cpu", **kw):
    dtype = "float32" if device == "cuda" else "auto"  # greedy tokens comparable with the CPU's
    return O3Model.from_config(O3Config(model_path=path, device=device, dtype=dtype, kv_block_size=16, **kw))


@pytest.fixture(scope="module")
def expected(tiny_dir):
    """Greedy tokens of the plain engine (no prefix cache, no tier) for SYSTEM and OTHER prompts."""
    plain = load(tiny_dir, dynamic_kv_cache=False)
    prompts = [plain.engine.encode(SYSTEM + "What is os?"), plain.engine.encode(OTHER + "Umbrella?")]
    return prompts, [plain.generate_batch([p], GREEDY)[0].token_ids for p in prompts]


def generate(model, ids):
    return model.generate_batch([ids], GREEDY)[0]


def evict_hot(model, expected):
    """Run OTHER through a pool of 11 blocks (it needs all but one), then a third prompt as long, so every
    one of SYSTEM's 10 blocks leaves the hot tier whatever order the allocator reuses free blocks in."""
    assert generate(model, expected[0][1]).token_ids == expected[1][1]
    generate(model, model.engine.encode(THIRD + "Why?"))
    model.engine.offloader.drain()


@pytest.mark.parametrize("device", DEVICES)
def test_cold_hit_copies_back_bit_identical_kv_and_gives_identical_tokens(tiny_dir, shm, expected, device):
    (prompt, _), (want, _) = expected
    m = load(tiny_dir, device, num_kv_blocks=11, cold_tier_mb=8, cold_tier_dir=shm)
    first = generate(m, prompt)
    assert first.cached_tokens == 0 and (first.token_ids == want or device != "cpu")
    runner, bs = m.engine.runner, 16
    full = (len(prompt) - 1) // bs * bs
    m.engine.offloader.drain()
    # the prompt's full blocks: what a cold hit restores (blocks holding generated tokens are recomputed
    # by later runs on other kernels, e.g. after a prefix hit, and may round differently)
    chunks = {tuple(prompt[i:i + bs]) for i in range(0, full, bs)}
    hashes = {b.hash: b.block_id for b in m.engine.blocks.blocks
              if b.hash is not None and tuple(b.token_ids) in chunks}
    assert len(hashes) == full // bs
    before = {h: runner.kv_cache[:, :, b * bs:(b + 1) * bs].clone() for h, b in hashes.items()}
    hot = generate(m, prompt)  # a hot hit computes only the suffix, as a cold hit will: the same kernels
    assert hot.cached_tokens == full
    want = hot.token_ids  # a whole-prompt prefill may round differently from a suffix's (GPU, CPU spans)
    evict_hot(m, expected)
    assert not set(hashes) & set(m.engine.blocks.cached)  # none of SYSTEM's blocks is hot any more
    again = generate(m, prompt)
    assert again.token_ids == want and again.cached_tokens == full
    stats = m.engine.stats()
    assert stats["cold_hit_tokens"] == full and stats["cold_restored_blocks"] == full // bs
    assert stats["cold_verified_blocks"] == 0  # this process wrote them: no second checksum
    for block in m.engine.blocks.blocks:
        if block.hash in before:  # restored into a different hot block, byte for byte the same
            assert torch.equal(runner.kv_cache[:, :, block.block_id * bs:(block.block_id + 1) * bs],
                               before[block.hash])
    m.engine.close()


def test_cold_tokens_reach_the_request_output(tiny_dir, shm, expected):
    (prompt, _), _ = expected
    m = load(tiny_dir, num_kv_blocks=11, cold_tier_mb=8, cold_tier_dir=shm)
    generate(m, prompt)
    m.engine.offloader.drain()
    evict_hot(m, expected)
    m.engine.add_request("r", prompt, GREEDY)
    outs = []
    while m.engine.has_unfinished_requests():
        outs += m.engine.step()[0]
    assert outs[-1].num_cold_tokens == outs[-1].num_cached_tokens > 0
    m.engine.close()


def test_tier_on_and_off_give_identical_greedy_output(tiny_dir, shm, expected):
    prompts, want = expected
    off = load(tiny_dir, num_kv_blocks=11)
    on = load(tiny_dir, num_kv_blocks=11, cold_tier_mb=8, cold_tier_dir=shm)
    for _ in range(2):
        for p, w in zip(prompts, want):
            assert generate(off, p).token_ids == w
            assert generate(on, p).token_ids == w
        on.engine.offloader.drain()
    assert on.engine.stats()["cold_hit_tokens"] > 0 and off.engine.stats()["cold_tier"] == "off"
    on.engine.close()


RESTART = """
import json, sys
sys.path.insert(0, {repo!r})
from o3edge import O3Config, O3Model
from o3edge.engine.kv_offload import KVOffloader, _runs, by_slot
from o3edge.engine.sequence import SamplingParams
m = O3Model.from_config(O3Config(model_path={model!r}, device={device!r}, dtype="float32", kv_block_size=16,
                                 cold_tier_mb=8, cold_tier_dir={shm!r}))
r = m.generate_batch([{prompt!r}], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
m.engine.offloader.drain()
stats = m.engine.stats()
m.engine.close()
print(json.dumps({{"tokens": r.token_ids, "cached": r.cached_tokens, "stats": stats}}))
"""


def run_engine_process(tiny_dir, shm, prompt, device="cpu") -> dict:
    import json
    code = RESTART.format(repo=REPO, model=tiny_dir, shm=shm, prompt=prompt, device=device)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("device", DEVICES)
def test_a_new_process_reattaches_and_gets_cold_hits(tiny_dir, shm, expected, device):
    (prompt, _), (want, _) = expected
    first = run_engine_process(tiny_dir, shm, prompt, device)
    assert first["cached"] == 0 and (first["tokens"] == want or device != "cpu")
    want = first["tokens"]
    assert first["stats"]["cold_blocks"] == (len(prompt) + 16) // 16  # prompt and output, full blocks
    second = run_engine_process(tiny_dir, shm, prompt, device)
    assert second["tokens"] == want and second["cached"] == (len(prompt) - 1) // 16 * 16
    assert second["stats"]["cold_hit_tokens"] == second["cached"]
    assert second["stats"]["cold_verified_blocks"] == second["cached"] // 16  # each checked on first use


@pytest.mark.parametrize("device", DEVICES)
def test_a_corrupt_byte_is_recomputed_with_identical_output(tiny_dir, shm, expected, device):
    (prompt, _), _ = expected
    want = run_engine_process(tiny_dir, shm, prompt, device)["tokens"]  # another process wrote the tier
    (segment,) = os.listdir(shm)
    m = load(tiny_dir, device, num_kv_blocks=11, cold_tier_mb=8, cold_tier_dir=shm)
    tier = m.engine.offloader.tier
    second_block = ct.chain_hash(ct.chain_hash(m.engine.blocks.root, prompt[:16]), prompt[16:32])
    with open(os.path.join(shm, segment), "r+b") as fh:  # a stray write through the file
        fh.seek(tier.payload_offset(tier.slot_of(second_block)) + 999)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x10]))
    r = generate(m, prompt)
    assert r.token_ids == want
    assert r.cached_tokens == 16  # the first block came in; the corrupt second and all after it were computed
    assert m.engine.stats()["cold_checksum_failures"] == 1 and second_block not in tier
    m.engine.close()


@pytest.mark.parametrize("device", DEVICES)
def test_preemption_swaps_blocks_out_and_back_with_identical_output(tiny_dir, shm, device):
    roomy = load(tiny_dir, device)
    prompts = [roomy.engine.encode(f"def function_{i}(x):\n    return x * {i} + helper_{i}(x)") for i in range(6)]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    want = [r.token_ids for r in roomy.generate_batch(prompts, params)]
    tight = O3Model.from_config(O3Config(model_path=tiny_dir, device=device, dtype=roomy.engine.info.dtype,
                                         kv_block_size=8, num_kv_blocks=12, cold_tier_mb=8, cold_tier_dir=shm))
    got = [r.token_ids for r in tight.generate_batch(prompts, params)]
    stats = tight.engine.stats()
    assert stats["preemptions"] > 0 and stats["cold_restored_blocks"] > 0  # resumed from the tier
    assert got == want
    assert tight.engine.blocks.num_free_blocks == 12
    tight.engine.close()


@pytest.mark.gpu
def test_gpu_arena_is_pinned_and_offload_waits_on_the_device_not_the_host(tiny_dir, shm, expected):
    (prompt, other), _ = expected
    m = load(tiny_dir, "cuda", num_kv_blocks=11, cold_tier_mb=8, cold_tier_dir=shm)
    copier = m.engine.offloader.copier
    assert copier.registered and copier.slab(0).is_pinned()  # cudaHostRegister took the arena
    generate(m, prompt)
    generate(m, other)  # overwrites blocks whose copies may still be queued: ordered on the device
    m.engine.offloader.drain()
    assert m.engine.stats()["cold_offloaded_blocks"] >= 9
    m.engine.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_block_overwritten_right_after_its_offer_goes_out_with_its_old_contents(shm, device):
    """Whether the copier thread or the engine thread (claiming a batch still queued) launches the copy,
    the tier gets what the block held when it was offered, never what the engine wrote next (on CUDA
    the overwrite is ordered after the copy on the device)."""
    bs, num_blocks, L, H, D = 4, 6, 2, 2, 8
    kv = torch.zeros(L, 2, (num_blocks + 1) * bs, H, D, device=device)
    payload = L * 2 * bs * H * D * 4
    tier = ct.ColdTier(shm, b"\x07" * 16, ct.ColdTier.size_for(64, bs, payload), bs, payload)
    off = KVOffloader(tier, kv, bs, verify_threads=2)
    names = []
    for i in range(48):
        b = i % num_blocks
        kv[:, :, b * bs:(b + 1) * bs] = i
        tokens = tuple(range(i * bs, (i + 1) * bs))
        names.append((ct.chain_hash(b"\x00" * 16, tokens), b"\x00" * 16, tokens))
        off.offer(b, *names[-1])
        if i % 3:
            off.flush()  # queued for the copier thread (else only offered: the overwrite flushes it)
        off.before_overwrite(b)
        kv[:, :, b * bs:(b + 1) * bs] = -1.0  # the engine's next write into the block
    assert off.drain()
    assert off.counts["cold_offloaded_blocks"] == 48
    for i, name in enumerate(names):
        slot = tier.verify(*name)
        assert slot is not None and np.all(np.frombuffer(tier.payload(slot), dtype=np.float32) == i)
    off.close()


def test_consecutive_slots_make_one_copy_each_run():
    assert _runs([3, 4, 5, 9, 10, 2]) == [(0, 3), (3, 2), (5, 1)]
    assert _runs([7]) == [(0, 1)] and _runs([]) == []


def test_a_chain_stored_tail_first_is_restored_in_one_run():
    """A finished sequence frees (and offers) its blocks tail first, so its chain lands in descending
    slots: sorted by slot, each block still goes to its own hot block, and the slabs make one run."""
    ids, slots = by_slot([40, 41, 42, 43], [12, 11, 10, 9])
    assert (ids, slots) == ([43, 42, 41, 40], [9, 10, 11, 12]) and _runs(slots) == [(0, 4)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_slow_restore_copy_lands_before_the_step_reads_its_blocks(tiny_dir, shm, expected, device):
    """A cold hit's copies run while the engine prepares the step (CPU: on a thread; CUDA: on the
    restore stream), and the step's first kernel waits for them (CPU: the thread; CUDA: an event, on
    the device): with every copy held back, the cold hit still gives the hot hit's tokens (a forward
    that read its blocks early would attend over stale K/V)."""
    (prompt, _), _ = expected
    m = load(tiny_dir, device, num_kv_blocks=11, cold_tier_mb=8, cold_tier_dir=shm)
    generate(m, prompt)
    hot = generate(m, prompt)  # the suffix over the cached prefix, as the cold hit computes it
    assert hot.cached_tokens > 0
    evict_hot(m, expected)
    m.engine.offloader.copier.copy_delay_s = 0.5
    cold = generate(m, prompt)
    assert cold.token_ids == hot.token_ids and cold.cached_tokens == hot.cached_tokens
    assert m.engine.stats()["cold_restored_blocks"] == hot.cached_tokens // 16
    m.engine.close()


@pytest.mark.gpu
def test_gpu_cold_hit_copies_a_chain_in_one_copy(tiny_dir, shm, expected):
    (prompt, _), (want, _) = expected
    m = load(tiny_dir, "cuda", num_kv_blocks=11, cold_tier_mb=8, cold_tier_dir=shm)
    generate(m, prompt)
    evict_hot(m, expected)
    copier = m.engine.offloader.copier
    copies = copier.counts["cold_restore_copies"]
    generate(m, prompt)
    full_blocks = (len(prompt) - 1) // 16  # the last prompt token is always computed
    assert full_blocks >= 8 and m.engine.stats()["cold_restored_blocks"] == full_blocks
    assert copier.counts["cold_restore_copies"] - copies == 1  # all of them in one copy
    m.engine.close()


def test_a_copier_that_cannot_start_leaves_the_engine_serving_without_the_tier(tiny_dir, shm, monkeypatch, caplog):
    import o3edge.engine.kv_offload as ko

    def broken(*args, **kwargs):
        raise RuntimeError("no copier here")

    monkeypatch.setattr(ko, "HostCopier", broken)
    m = load(tiny_dir, cold_tier_mb=8, cold_tier_dir=shm)
    assert m.engine.offloader is None and "cold tier off: its copier could not start" in caplog.text
    assert m.engine.stats()["cold_tier"] == "off" and len(generate(m, [5, 6, 7]).token_ids) == 16
