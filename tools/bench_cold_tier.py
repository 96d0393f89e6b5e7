#!/usr/bin/env python3
"""KV cold tier benchmark: time to first token against prefix length, recompute vs hot hit vs cold hit.

For each prefix length, a request is a random prefix of that many tokens plus 16 new tokens:
  recompute  the prefix was never seen (a fresh random prefix each repetition)
  hot        the prefix is in the hot prefix cache (device memory, or RAM on CPU)
  cold       the prefix was offloaded to the shared-memory tier and dropped from the hot cache, so
             its blocks are copied back in (this process wrote them: no checksum on the way in)
  cold_verified  the cold case again with the process's memory of which slabs it wrote or checked
             cleared, as a restarted daemon finds them: each slab is verified before its copy
The hot request is made once untimed first, so that every full block of it is named (the prefix's
and the one the suffix completes, if any); the cold requests are that request again, so all three
find the same blocks and compute the same tokens, and `cold_token_equals_hot` says whether their
first tokens came out the same. TTFT is add_request -> first token out of engine.step() (on CUDA,
step() returns after the token is on the host); the cases are interleaved per repetition,
and medians are reported (all values are in the JSON). "restore ms" is the engine thread's time in
the restore (acquire, verify if needed, start the copies); "copy ms" is the copies' own time: on
CUDA their device time (events around the host-to-device copies), on CPU the copy thread's time; the
restore GB/s comes from it. `hot_phases_ms` and `cold_phases_ms` split the hot and cold TTFTs into
the engine thread's time in add_request, schedule, restore, the runner (host preparation, the wait
for restored blocks, the device's work and the token's way to the host) and the rest. The hot
cache is emptied between the cold runs by forgetting its names (`drop_hot_cache`), which is what
LRU eviction does once the offload has finished.

  python tools/bench_cold_tier.py /tmp/smol-135m --device cpu --threads 1 --lengths 250,1000,2000
  python tools/bench_cold_tier.py --shape llama-1b --device cuda --lengths 4096,16384 --decode-batch 32 --json OUT

--decode-batch N adds the offload's cost to decoding: the step time of N sequences decoding, alone
and with --offload-blocks blocks offered to the tier in the step (blocks of the pool's free list
under fresh names, as if requests finished alongside), in alternating runs of 9 steps, the first of
each run untimed (after the drain that starts a run without offers it finds the device idle, which
made that kind look faster). A step is timed to its return (its tokens on the host), with no
device-wide synchronize: that would also wait for the offload's side-stream copies, which the engine
never waits for. The pool holds 32 blocks a sequence, so the free list never runs short (with 12,
it shrank until the blocks offered were the ones the next step took, and the step waited for their
copies: the swap path, not the offload's cost).

Prints a table and, with --json, writes every measurement with the machine it ran on.
--plot PNG draws TTFT against prefix length, one panel per result file:

  python tools/bench_cold_tier.py --plot docs/img/cold-tier.png --results docs/results/cold-tier-*.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from o3edge import O3Config  # noqa: E402
from o3edge.engine.block_manager import chain_hash  # noqa: E402
from o3edge.engine.engine import LLMEngine  # noqa: E402
from o3edge.engine.sequence import SamplingParams  # noqa: E402
from machine_info import cpu_name  # noqa: E402

ONE = SamplingParams(max_new_tokens=1, ignore_eos=True)
SUFFIX = 16


class Phases:
    """The engine thread's time in the parts of a request's way to its first token, by wrapping the
    engine's own methods: add_request, schedule (admission: prefix and cold-tier lookups, block
    tables), restore (pinning, verifying, starting the copies), run (the runner: host preparation, the
    wait for restored blocks, the device's work and the token's way back to the host). "other" is the
    rest of the TTFT (the step's own bookkeeping, the detokenizer)."""

    def __init__(self, engine: LLMEngine):
        self.seconds: dict[str, float] = {}
        for name, owner, attr in (("add_request", engine, "add_request"), ("schedule", engine.scheduler, "schedule"),
                                  ("restore", engine, "_restore"), ("run", engine.runner, "run")):
            setattr(owner, attr, self._timed(name, getattr(owner, attr)))

    def _timed(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        return timed


def ttft(engine: LLMEngine, ids: list[int], phases: Phases | None = None) -> tuple[float, int, dict]:
    """(seconds from add_request to the first token, that token, seconds in each phase), with the
    engine otherwise idle."""
    rid = uuid.uuid4().hex
    if phases is not None:
        phases.seconds.clear()
    t0 = time.perf_counter()
    engine.add_request(rid, ids, ONE)
    while True:
        outs, _ = engine.step()
        out = next((o for o in outs if o.request_id == rid and o.token_ids), None)
        if out is not None:
            elapsed = time.perf_counter() - t0
            break
    parts = dict(phases.seconds) if phases is not None else {}
    if parts:
        parts["other"] = elapsed - sum(parts.values())
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed, out.token_ids[0], parts


def drop_hot_cache(engine: LLMEngine) -> None:
    """Forget every free block's name: the next request finds its prefix only in the cold tier."""
    blocks = engine.blocks
    for block in blocks.blocks:
        if block.ref_count == 0 and block.hash is not None:
            blocks.cached.pop(block.hash, None)
            block.hash, block.token_ids = None, ()


def restore_counts(engine: LLMEngine) -> tuple[float, float, int]:
    """(engine-thread seconds in restore, device seconds of the restore copies (CUDA; else 0), blocks)."""
    engine.offloader.drain()  # also collects finished restores' device times
    c = {**engine.offloader.counts, **engine.offloader.copier.counts}
    return c["cold_restore_seconds"], c.get("cold_restore_copy_seconds", 0.0), c["cold_restored_blocks"]


def measure(engine: LLMEngine, length: int, reps: int, rng: random.Random, vocab: int, phases: Phases) -> dict:
    """TTFTs of the three cases, interleaved per repetition so that a busy machine slows all three alike."""
    rand = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    prefix = rand(length)
    ttft(engine, rand(length + SUFFIX))  # warm-up at this shape
    ttft(engine, prefix + rand(SUFFIX))
    engine.offloader.drain()
    drop_hot_cache(engine)
    ttft(engine, prefix + rand(SUFFIX))  # and a first restore
    times = {"recompute": [], "hot": [], "cold": [], "cold_verified": [], "restore": [], "restore_copy": []}
    cold_tokens, same_token, parts = [], [], {"hot": [], "cold": []}
    for _ in range(reps):
        engine.offloader.drain()  # each case starts with no offload running (on a CPU it shares the cores)
        times["recompute"].append(ttft(engine, rand(length + SUFFIX))[0])
        suffix = rand(SUFFIX)
        ttft(engine, prefix + suffix)  # names every full block of this request, the suffix's too
        engine.offloader.drain()
        hot_s, hot_token, hot_parts = ttft(engine, prefix + suffix, phases)
        times["hot"].append(hot_s)
        parts["hot"].append(hot_parts)
        engine.offloader.drain()
        drop_hot_cache(engine)
        before, host_s, copy_s, _ = engine.blocks.num_cold_hit_tokens, *restore_counts(engine)
        cold_s, cold_token, cold_parts = ttft(engine, prefix + suffix, phases)  # the same request and token
        times["cold"].append(cold_s)
        parts["cold"].append(cold_parts)
        after = restore_counts(engine)
        times["restore"].append(after[0] - host_s)
        times["restore_copy"].append(after[1] - copy_s)
        cold_tokens.append(engine.blocks.num_cold_hit_tokens - before)
        same_token.append(cold_token == hot_token)
        # as a restarted daemon finds them: every slab is verified (header, tokens, checksum) before its copy
        engine.offloader.drain()
        drop_hot_cache(engine)
        engine.offloader.tier.checked.clear()
        verified_s, verified_token, _ = ttft(engine, prefix + suffix)
        times["cold_verified"].append(verified_s)
        same_token.append(verified_token == hot_token)
    ms = lambda x: round(x * 1000, 3)  # noqa: E731
    row = {"prefix_tokens": length, "cold_tokens": min(cold_tokens), "cold_token_equals_hot": all(same_token)}
    for case, xs in times.items():
        row[f"{case}_ms"] = ms(statistics.median(xs))
        row[f"{case}_min_ms"] = ms(min(xs))
        row[f"{case}_all_ms"] = [ms(x) for x in xs]
    for case, runs in parts.items():  # engine-thread time by phase, medians over the repetitions
        row[f"{case}_phases_ms"] = {k: ms(statistics.median(p.get(k, 0.0) for p in runs)) for k in runs[0]}
    row["cold_over_recompute"] = round(row["cold_ms"] / row["recompute_ms"], 3)
    row["hot_over_recompute"] = round(row["hot_ms"] / row["recompute_ms"], 3)
    row["cold_verified_over_recompute"] = round(row["cold_verified_ms"] / row["recompute_ms"], 3)
    nbytes = row["cold_tokens"] / engine.blocks.block_size * engine.offloader.tier.payload_bytes
    # the copy's own bandwidth: device time on CUDA (the host only queues it), the host's time on CPU
    copy_s = statistics.median(times["restore_copy"]) or statistics.median(times["restore"])
    row["restore_gb_per_s"] = round(nbytes / copy_s / 1e9, 2) if copy_s > 0 else None
    return row


def decode_overhead(engine: LLMEngine, batch: int, offers: int, rng: random.Random, vocab: int,
                    steps: int = 64) -> dict:
    """Decode step time of `batch` sequences, without and with `offers` block offloads per step.

    Each step is timed from engine.step() to its return, which is when its tokens are on the host;
    nothing else waits for the device (a device-wide synchronize would also wait for the offload's
    copies on their side stream, which the engine never does). The offers are made inside the timed
    region, as a request ending in the step makes them; the blocks offered rotate through the most
    recently freed quarter of the free list (where a finished request's blocks go; the allocator
    takes from the other end) under fresh names.
    """
    params = SamplingParams(max_new_tokens=2 * steps + 16, ignore_eos=True)
    rids = [uuid.uuid4().hex for _ in range(batch)]
    for rid in rids:
        engine.add_request(rid, [rng.randrange(3, vocab) for _ in range(64)], params)
    while any(engine.seqs[r].num_output_tokens == 0 for r in rids):
        engine.step()
    bs = engine.blocks.block_size
    names = []
    for _ in range((steps + steps // 8 + 9) * offers):
        tokens, parent = tuple(rng.randrange(3, vocab) for _ in range(bs)), rng.randbytes(16)
        names.append((chain_hash(parent, tokens), parent, tokens))
    for _ in range(3):
        engine.step()
    base, loaded, k = [], [], 0
    for i in range(2 * steps + steps // 8):  # runs of 9 steps of each kind, so that a busy machine slows both alike
        with_offers = (i // 9) % 2 == 1
        if not with_offers and i % 9 == 0:
            engine.offloader.drain()  # no copy of the previous run still going
        free = list(engine.blocks.free)
        pool = free[-len(free) // 4:]  # the most recently freed quarter: where a real free puts its blocks
        t0 = time.perf_counter()
        if with_offers:
            for j in range(offers):
                engine.offloader.offer(pool[(k * offers + j) % len(pool)], *names[k * offers + j])
            k += 1
        engine.step()
        if i % 9:  # a run's first step is not timed: after the drain it finds the device idle
            (loaded if with_offers else base).append(time.perf_counter() - t0)
    engine.offloader.drain()
    for rid in rids:
        engine.abort(rid)
    b, w = statistics.median(base) * 1000, statistics.median(loaded) * 1000
    mb, mw = statistics.mean(base) * 1000, statistics.mean(loaded) * 1000
    return {"batch": batch, "offload_blocks_per_step": offers, "steps_each": steps,
            "offload_mb_per_step": round(offers * engine.offloader.tier.payload_bytes / 2**20, 2),
            "step_ms": round(b, 3), "step_with_offload_ms": round(w, 3), "overhead": round(w / b - 1, 4),
            "mean_step_ms": round(mb, 3), "mean_step_with_offload_ms": round(mw, 3),
            "mean_overhead": round(mw / mb - 1, 4),
            "step_all_ms": [round(x * 1000, 3) for x in base],
            "step_with_offload_all_ms": [round(x * 1000, 3) for x in loaded]}


def plot(results: list[dict], path: str) -> None:
    """TTFT against prefix length for recompute, hot and cold, one log-log panel per result."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.8), dpi=90, squeeze=False)
    for ax, res in zip(axes[0], results):
        x = [r["prefix_tokens"] for r in res["rows"]]
        for case, style in (("recompute", "o-"), ("hot", "s--"), ("cold", "^-"), ("cold_verified", "v:")):
            if all(f"{case}_ms" in r for r in res["rows"]):
                ax.plot(x, [r[f"{case}_ms"] for r in res["rows"]], style,
                        label="cold, verified (restart)" if case == "cold_verified" else case)
        n = res["machine"]["threads"]
        where = res["machine"].get("gpu") or f"{res['machine'].get('cpu', 'CPU')}, {n} thread{'s' * (n != 1)}"
        ax.set(xscale="log", yscale="log", xlabel="prefix tokens", ylabel="TTFT (ms)",
               title=f"{res.get('shape') or res['model']} {res['dtype']}, {where}\n{res['date']}")
        ax.set_xticks(x, [str(v) for v in x], minor=False)
        ax.set_xticks([], minor=True)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def machine(device: torch.device) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "threads": torch.get_num_threads()}
    info["cpu"] = cpu_name()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="checkpoint or engine directory (or use --shape)")
    ap.add_argument("--shape", help="make a random-weight checkpoint of this shape (tools/make_tiny_model.py)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lengths", default="1000", help="comma-separated prefix lengths in tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, help="CPU threads for torch")
    ap.add_argument("--block-size", type=int, default=O3Config.kv_block_size, help="KV block size in tokens")
    ap.add_argument("--cold-tier-mb", type=int, default=0, help="default: room for the longest prefix twice")
    ap.add_argument("--cold-tier-dir", default="/dev/shm")
    ap.add_argument("--decode-batch", type=int, default=0, help="also measure the offload's cost to decoding")
    ap.add_argument("--offload-blocks", type=int, default=8, help="blocks offloaded per decode step")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="draw TTFT against prefix length into this PNG")
    ap.add_argument("--results", nargs="+", help="with --plot: plot these result files instead of running")
    a = ap.parse_args()
    if a.results:
        results = []
        for path in a.results:
            with open(path) as fh:
                results.append(json.load(fh))
        return plot(results, a.plot)
    start = time.perf_counter()
    if a.threads:
        torch.set_num_threads(a.threads)
    lengths = [int(x) for x in a.lengths.split(",")]
    model_dir = a.model
    if model_dir is None:
        from o3edge.tiny import make_checkpoint
        from tools.make_tiny_model import SHAPES
        model_dir = os.path.join(tempfile.gettempdir(), f"o3edge-bench-{a.shape}")  # shared with bench_gpu.py
        if not os.path.exists(os.path.join(model_dir, "config.json")):
            print(f"making {a.shape} checkpoint in {model_dir}", flush=True)
            make_checkpoint(model_dir, **SHAPES[a.shape])
    longest = max(max(lengths) + SUFFIX + 1, 512 if a.decode_batch else 0)  # decoding runs ~250 steps
    probe = LLMEngine(O3Config(model_path=model_dir, device=a.device, dtype=a.dtype, num_kv_blocks=2, cuda_graphs=False,
                               max_model_len=longest + 1, kv_block_size=a.block_size), model_dir)
    block_mb = probe.info.kv_cache_bytes / 2 / 2**20
    blocks_needed = -(-longest // probe.info.kv_block_size)
    del probe
    gc.collect()
    cold_mb = a.cold_tier_mb or int(block_mb * blocks_needed * 2) + 8
    config = O3Config(model_path=model_dir, device=a.device, dtype=a.dtype, max_model_len=longest + 1,
                      num_kv_blocks=max(blocks_needed * 2 + 2, a.decode_batch * 32), max_num_batched_tokens=longest,
                      max_num_seqs=max(32, a.decode_batch), kv_block_size=a.block_size,
                      cold_tier_mb=cold_mb, cold_tier_dir=a.cold_tier_dir, num_threads=a.threads)
    engine = LLMEngine(config, model_dir)
    assert engine.offloader is not None, "the cold tier did not start (see the warning above)"
    if engine.runner.kv_cache.device.type == "cpu":
        # the CPU pool's pages are mapped on first write: touch them all now, as a long-running daemon's
        # are (else whichever case first writes a block pays its page faults: ~0.3 GB/s here)
        engine.runner.kv_cache.view(-1)[::1024].zero_()
    rng, rows, phases = random.Random(0), [], Phases(engine)
    print(f"{'prefix':>7} {'recompute ms':>13} {'hot ms':>8} {'cold ms':>8} {'cold/recompute':>15} "
          f"{'hot/recompute':>14} {'restore ms':>11} {'copy ms':>8} {'GB/s':>6} {'verified ms':>12} same-token")
    for length in lengths:
        row = measure(engine, length, a.reps, rng, engine.info.args.vocab_size, phases)
        rows.append(row)
        print(f"{length:>7} {row['recompute_ms']:>13.1f} {row['hot_ms']:>8.2f} {row['cold_ms']:>8.2f} "
              f"{row['cold_over_recompute']:>15.3f} {row['hot_over_recompute']:>14.3f} {row['restore_ms']:>11.2f} "
              f"{row['restore_copy_ms']:>8.2f} {row['restore_gb_per_s'] or 0:>6.1f} {row['cold_verified_ms']:>12.2f} "
              f"{row['cold_token_equals_hot']}",
              flush=True)
        for case in ("hot", "cold"):
            print(f"{'':>7} {case} phases (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in row[f"{case}_phases_ms"].items()))
    decode = None
    if a.decode_batch:
        decode = decode_overhead(engine, a.decode_batch, a.offload_blocks, rng, engine.info.args.vocab_size)
        print(f"decode, batch {decode['batch']}: {decode['step_ms']:.3f} ms/step alone, "
              f"{decode['step_with_offload_ms']:.3f} ms with {decode['offload_blocks_per_step']} blocks "
              f"({decode['offload_mb_per_step']} MiB) offloaded per step ({decode['overhead']:+.1%}; "
              f"means {decode['mean_step_ms']:.3f} -> {decode['mean_step_with_offload_ms']:.3f} ms, "
              f"{decode['mean_overhead']:+.1%})")
    stats = engine.stats()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
              "model": os.path.basename(os.path.normpath(model_dir)), "shape": a.shape, "device": engine.info.device,
              "dtype": engine.info.dtype, "kv_block_size": engine.info.kv_block_size, "cold_tier_mb": cold_mb,
              "machine": machine(torch.device(engine.info.device)), "wall_s": round(time.perf_counter() - start, 1),
              "rows": rows, "decode": decode,
              "cold_tier": {k: v for k, v in stats.items() if k.startswith("cold_")}}
    engine.close()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {a.json}")
    if a.plot:
        plot([result], a.plot)


if __name__ == "__main__":
    main()
