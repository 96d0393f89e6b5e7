#!/usr/bin/env python3
"""The token router's worth, measured: KV bytes per token against quality, five KV settings in one run.

  python tools/bench_router.py [--model DIR] [--prompts 4] [--prompt-tokens 640] [--new-tokens 256]
                               [--device cpu|cuda] [--dtype float32] [--only LABELS] [--tuned]
                               [--json docs/results/router-cpu-<date>.json] [--plot docs/img/router-cpu.png]
  python tools/bench_router.py --capacity [--capacity-seqs 8] [--capacity-budget 3] [--device ...] [--json ...]
  python tools/bench_router.py --gpu [--shape llama-1b] [--context 4096] [--batch 16] [--json ...]
  python tools/bench_router.py --speed [--prompts 2] [--prompt-tokens 1500] [--new-tokens 64] [--rounds 3] [--json ...]

Settings, all on the same model in the same run: `off` (full-precision KV), `uniform-int8` and
`uniform-int4` (every sealed block compressed, no token kept: what llama.cpp's -ctk/-ctv q8_0/q4_0
do, except that the block being filled, at most kv_block_size - 1 tokens, stays full precision),
`router-int8` and `router-int4` (the router's defaults: threshold 0.85, 4 sink and 128 recent tokens).

Quality (default): prompts are held-out documentation pages (tools/reference_corpus.py, never
trained on). `off` generates --new-tokens greedy tokens from each prompt; every other setting is then
teacher-forced along the same tokens, giving, per step, the KL divergence of its next-token
distribution from `off`'s and whether its top-1 token agrees; and it also generates freely, giving the
share of the --new-tokens greedy tokens identical to `off`'s at the same position (free-running: after
one early near-tie flip every later position can count as a miss) and the tokens until the first
divergence (per prompt, the free-running tokens before the first that differs from `off`'s,
--new-tokens if none; the mean over prompts), which says how early the flips come. KV bytes per
token are taken from the router's pool shares at the end of each run, as bf16 storage would hold them
(the engine keeps KV in --dtype; the ratio is what matters). Needle retrieval: a pass key placed at
several depths of filler text of several lengths, asked for at the end; and a passage copy (the model
is shown a passage earlier and given its start at the end; the score is how many of the next 16 tokens
it reproduces).

The quality and capacity modes run on --device (cpu, the default, or cuda / cuda:N) in --dtype
(float32 by default; the logits are compared in float32 on the CPU whatever the device); the JSON
records the device, its name (the GPU's, or the CPU model), the dtype and the torch threads. On CUDA
the quality engines run without CUDA graphs: a captured greedy decode step launches the next step
ahead and returns no logits (cuda_graph.py), and every compressed setting runs eager anyway. --only
LABELS (comma-separated) limits the settings; quality always runs `off`, its reference. --floor adds
`router-keep-all`, the router's attention path keeping every token at full precision: its distance from
`off` is the floor set by the two attention paths (and an INT4-FFN model's activation rounding), not
by compression. With --json, the file is rewritten after each setting (with "partial": true until the
end), so a run cut short keeps the settings it finished.

CPU speed (--speed, on --device): the time to prefill --prompts held-out prompts of --prompt-tokens at once
(one new token each: the prompt's routing included) and decode tokens/s over --new-tokens from other held-out
prompts, every setting on the torch engine, whole generations timed from outside it (--rounds alternates).

GPU speed (--gpu): decode tokens/s at --context tokens and --batch sequences, random weights of --shape,
bf16: `off` on the CUDA-graph decode step and the compressed settings with router_cuda_graphs
(router_graph.py: every decode step in CUDA graphs, refresh steps in their observing graphs; --eager
adds every setting without graphs), with each setting's KV bytes per token and compressed share from the
engine's stats, and the wall time of each engine step (percentiles, and the sum of the slowest
sixteenth: the refresh steps, one in 32 by default, and the steps after them; the median of each step
kind: refresh, after refresh, demoting, other). --rounds N runs every setting N times, alternating, and
reports the median tok/s and each round's ratio to full precision (a small model's step is mostly host
time, and the GPU machine's speed has moved by up to 1.8x between two runs of one call). --floor adds
`router-unobserved` there: the router's step with nothing compressed and nothing observed. On random
weights attention is flat, so the router keeps every token and reads as many bytes as `off`; `--shape
model` runs --model's checkpoint (the built-in long-context reference model by default: 4,096
positions) on held-out stdlib docstrings instead, where the router compresses what its attention passes
over:

  python tools/bench_router.py --gpu --shape model --context 3840 --batch 16 [--rounds 3] --json ...
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TOOLS)
sys.path.insert(0, REPO)
sys.path.insert(0, TOOLS)

from o3edge.config import O3Config  # noqa: E402
from o3edge.engine.engine import LLMEngine  # noqa: E402
from o3edge.engine.kv_quant import bytes_per_vector  # noqa: E402
from o3edge.engine.sequence import SamplingParams, Sequence  # noqa: E402
from o3edge.model_path import resolve_model_path  # noqa: E402
from machine_info import cpu_name  # noqa: E402

# label -> engine settings
SETTINGS = {
    "off": dict(kv_router="off"),
    "uniform-int8": dict(kv_router="int8", router_threshold=0.0, sink_tokens=0, recent_tokens=0),
    "uniform-int4": dict(kv_router="int4", router_threshold=0.0, sink_tokens=0, recent_tokens=0),
    "router-int8": dict(kv_router="int8"),
    "router-int4": dict(kv_router="int4"),
}
# --tuned adds these: what a 1,024-token model needs instead of the defaults (less kept for position)
TUNED = {
    "router-int8-tuned": dict(kv_router="int8", router_threshold=0.5, sink_tokens=4, recent_tokens=32),
    "router-int4-tuned": dict(kv_router="int4", router_threshold=0.5, sink_tokens=4, recent_tokens=32),
}
# --blocks adds these: whole blocks, most salient first, cover the threshold (router_select = "blocks")
BLOCKS = {
    "router-int8-blocks": dict(kv_router="int8", router_select="blocks"),
    "router-int4-blocks": dict(kv_router="int4", router_select="blocks"),
}
# --floor adds this control: the router's attention path with every token kept full precision (nothing
# is ever compressed), so what it differs from `off` by is the path's, not compression's (a different
# attention computation than off's; on an INT4-FFN model the FFN rounds its activations, to int8 groups
# on the CPU and bf16 on CUDA, which turns float32 reordering noise into visible logit differences)
FLOOR = {"router-keep-all": dict(kv_router="int8", router_threshold=1.0, sink_tokens=1 << 30, recent_tokens=1 << 30)}
# and, for --gpu, the router's decode step alone: nothing compressed and nothing observed (threshold 0)
FLOOR_GPU = {"router-unobserved": dict(kv_router="int8", router_threshold=0.0, sink_tokens=1 << 30, recent_tokens=0)}


def engine(model_dir: str, label: str, device: str, dtype: str, threads: int | None, **kw) -> LLMEngine:
    cfg = O3Config(model_path=model_dir, device=device, dtype=dtype, num_threads=threads, **SETTINGS[label], **kw)
    return LLMEngine(cfg, model_dir)


def device_info(eng: LLMEngine, threads: int | None) -> dict:
    """Where a run ran: the engine's device and dtype, the device's name (the GPU's, or the CPU model),
    torch's CPU threads (as requested and as set)."""
    dev = torch.device(eng.info.device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = cpu_name()
    return {"device": str(dev), "device_name": name, "dtype": eng.info.dtype, "threads": threads,
            "torch_threads": torch.get_num_threads()}


def first_divergence(tokens: list[int], ref: list[int]) -> int:
    """Tokens before the first one that differs from ref's at the same position (len(ref) if none)."""
    return next((i for i, (x, y) in enumerate(zip(tokens, ref)) if x != y), len(ref))


def labels_of(a) -> list[str]:
    """The settings to run: --only's, or all."""
    return a.only.split(",") if a.only else list(SETTINGS)


def free_device_memory() -> None:
    """After a setting's engine is dropped: collect it, and give its KV pool back to the GPU."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bytes_per_token(eng: LLMEngine, mode: str, full_share: float, elem: int = 2) -> float:
    """KV bytes per token with full-precision tokens stored at `elem` bytes (bf16: 2)."""
    a = eng.info.args
    full = a.num_layers * 2 * a.num_kv_heads * a.head_dim * elem
    if mode == "off":
        return float(full)
    comp = a.num_layers * 2 * a.num_kv_heads * bytes_per_vector(mode, a.head_dim)
    return full_share * full + (1 - full_share) * comp


def run_tokens(eng: LLMEngine, prompt: list[int], new: int, forced: list[int] | None = None):
    """Prefill the prompt, then `new` decode steps, feeding `forced` tokens (None: greedy). Returns
    (logits [new, V], tokens, share of the sequence's tokens in full-precision blocks at the end)."""
    seq = Sequence("bench", list(prompt), SamplingParams(max_new_tokens=new + 1, ignore_eos=True))
    eng.blocks.allocate(seq, reuse=False)
    runner, logits, tokens = eng.runner, [], []
    try:
        n = len(seq)
        for i in range(new):
            runner.run([(seq, n)])
            eng.blocks.mark_computed(seq, n)
            row = runner.last_logits[0].to("cpu", torch.float32, copy=True)  # a buffer on some paths
            logits.append(row)
            tok = forced[i] if forced is not None else int(row.argmax())
            tokens.append(tok)
            seq.token_ids.append(tok)
            eng.blocks.append_slot(seq)
            n = 1
        share = 1.0
        if runner.router is not None:
            share = kept_by(eng, seq)
    finally:
        eng.blocks.free_seq(seq)
        runner.release(seq)
    return torch.stack(logits), tokens, share


def kept_by(eng: LLMEngine, seq: Sequence) -> dict:
    """Share of a sequence's blocks in each state at its end: compressed, or kept full precision as a
    sink block, a block of the recent window, the block being filled, or for its saliency."""
    bs, cfg = eng.blocks.block_size, eng.runner.router.cfg
    ctx = seq.num_computed_tokens
    used = seq.block_table[:-(-ctx // bs)]
    out = dict.fromkeys(("compressed", "sink", "recent", "filling", "salient"), 0)
    for i, b in enumerate(used):
        lo, hi = i * bs, (i + 1) * bs
        why = ("compressed" if eng.blocks.is_compressed(b) else "filling" if hi > ctx else "sink"
               if lo < cfg.sink_tokens else "recent" if hi > ctx - cfg.recent_tokens else "salient")
        out[why] += 1
    return {k: v / len(used) for k, v in out.items()}


def held_out(tok, n_prompts: int, length: int) -> tuple[list[list[int]], list[int]]:
    """n_prompts windows of held-out documentation, and more held-out tokens for filler. Where this machine has no
    Python documentation (python3.11-doc) and no corpus pack, the held-out modules' docstrings of Python's own
    library, which every machine has, stand in (said on stderr)."""
    import reference_corpus

    source = "docs"
    if not os.path.exists(reference_corpus.DEFAULT_PACK) and reference_corpus.docs_dir() is None:
        source = "stdlib"
        print("no Python documentation here: held-out stdlib docstrings as prompts", file=sys.stderr)
    _, _, held = reference_corpus.split(reference_corpus.load(None, (source,)))
    ids: list[int] = []
    for text in held.values():
        ids += tok.encode(text, add_special_tokens=False)
    prompts = [ids[i * length:(i + 1) * length] for i in range(n_prompts)]
    return prompts, ids[n_prompts * length:]


def needle_cases(tok, filler: list[int], lengths, depths):
    """(length, depth, prompt ids, answer text) for the pass-key task."""
    import passkey

    cases = []
    for L in lengths:
        for d in depths:
            key = str(random.Random(L * 100 + int(d * 100)).randint(10000, 99999))
            ex = passkey.example(lambda t: tok.encode(t, add_special_tokens=False), filler, L, d, key)
            cases.append((L, d, ex.prompt, key))
    return cases


def copy_cases(filler: list[int], lengths, depths):
    """(length, depth, prompt ids, the 16 answer ids): a 48-token passage placed at depth, its first 24
    tokens repeated at the end."""
    cases, src = [], filler[len(filler) // 2:]
    for L in lengths:
        for d in depths:
            s = random.Random(L * 10 + int(d * 10)).randint(0, len(src) - 100)
            passage = src[s:s + 48]
            body = filler[:L - 48 - 24]
            cut = int(len(body) * d)
            cases.append((L, d, body[:cut] + passage + body[cut:] + passage[:24], passage[24:40]))
    return cases


def quality(a) -> dict:
    model_dir = resolve_model_path(a.model)
    labels = ["off"] + [x for x in labels_of(a) if x != "off"]
    unknown = [x for x in labels if x not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown settings {unknown} (known: {', '.join(SETTINGS)}; --tuned adds the -tuned ones)")
    # no CUDA graphs: a graphed greedy decode step returns no logits (it launches the next step ahead)
    ref = engine(model_dir, "off", a.device, a.dtype, a.threads, cuda_graphs=False)
    where = device_info(ref, a.threads)
    print("quality on", where, flush=True)
    tok = ref.tokenizer
    prompts, filler = held_out(tok, a.prompts, a.prompt_tokens)
    if any(len(p) != a.prompt_tokens for p in prompts):
        raise SystemExit(f"the held-out text is too short for {a.prompts} prompts of {a.prompt_tokens} tokens")
    reference = [run_tokens(ref, p, a.new_tokens) for p in prompts]
    lengths, depths = [int(x) for x in a.needle_lengths.split(",")], [float(x) for x in a.needle_depths.split(",")]
    needles, copies = needle_cases(tok, filler, lengths, depths), copy_cases(filler, lengths, depths)
    rows = {}
    a_ = ref.info.args
    model = os.path.relpath(model_dir, REPO) if model_dir.startswith(REPO) else model_dir
    result = {"mode": f"{where['device'].split(':')[0]}-quality", "model": model, **where,
           "model_shape": {"layers": a_.num_layers, "kv_heads": a_.num_kv_heads, "head_dim": a_.head_dim,
                           "max_position_embeddings": a_.max_position_embeddings},
           "prompts": a.prompts, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
           "kv_block_size": ref.config.kv_block_size, "settings": {k: SETTINGS[k] for k in labels},
           "results": rows}
    for label in labels:
        t0 = time.perf_counter()
        eng = ref if label == "off" else engine(model_dir, label, a.device, a.dtype, a.threads, cuda_graphs=False)
        mode = SETTINGS[label]["kv_router"]
        kls, agree, free_same, diverge, shares, why = [], [], [], [], [], []
        for p, (ref_logits, ref_tokens, _) in zip(prompts, reference):
            logits, _, share = run_tokens(eng, p, a.new_tokens, forced=ref_tokens)
            logp_ref, logp = F.log_softmax(ref_logits, -1), F.log_softmax(logits, -1)
            kls += (logp_ref.exp() * (logp_ref - logp)).sum(-1).tolist()
            agree += (logits.argmax(-1) == ref_logits.argmax(-1)).tolist()
            _, free, _ = run_tokens(eng, p, a.new_tokens)
            free_same.append(sum(x == y for x, y in zip(free, ref_tokens)) / len(ref_tokens))
            diverge.append(first_divergence(free, ref_tokens))
            shares.append(1.0 if isinstance(share, float) else 1 - share["compressed"])
            if not isinstance(share, float):
                why.append(share)
        needle = []
        for L, d, ids, key in needles:
            _, out, _ = run_tokens(eng, ids, 8)
            needle.append({"length": L, "depth": d, "found": key in tok.decode(out).replace(" ", "")})
        copy = []
        for L, d, ids, ans in copies:
            _, out, _ = run_tokens(eng, ids, 16)
            k = 0
            while k < 16 and out[k] == ans[k]:
                k += 1
            copy.append({"length": L, "depth": d, "tokens_copied": k})
        share = sum(shares) / len(shares)
        rows[label] = {
            "kv_bytes_per_token_bf16": round(bytes_per_token(eng, mode, share), 1),
            "kv_bytes_vs_bf16": round(bytes_per_token(eng, mode, share) / bytes_per_token(eng, "off", 1.0), 4),
            "full_precision_token_share": round(share, 4),
            "mean_kl_nats": sum(kls) / len(kls), "max_kl_nats": max(kls),
            "top1_agreement_forced": sum(agree) / len(agree),
            "greedy_agreement_free": sum(free_same) / len(free_same),
            "greedy_agreement_free_per_prompt": free_same,
            "greedy_tokens_until_divergence": sum(diverge) / len(diverge),
            "greedy_tokens_until_divergence_per_prompt": diverge,
            "needle_found": sum(n["found"] for n in needle) / len(needle), "needle": needle,
            "copy_tokens_mean": sum(c["tokens_copied"] for c in copy) / len(copy), "copy": copy,
            "blocks_by_state": {k: round(sum(w[k] for w in why) / len(why), 4) for k in why[0]} if why else None,
            "engine_kv_stats": {k: v for k, v in eng.stats().items() if k.startswith("kv_")},
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(label, {k: v for k, v in rows[label].items() if not isinstance(v, list)}, flush=True)
        save(a, result, partial=True)
        if eng is not ref:
            del eng  # free its KV pool before the next setting's engine takes one
            free_device_memory()
    return result


def gpu_prompts(path: str, a, vocab: int):
    """(prompts, warm-up prompts) for --gpu: random tokens on a random-weight shape; with --shape model,
    windows of held-out stdlib docstrings (distinct for every sequence; the text wraps round when short),
    so that a trained model's attention decides what the router keeps."""
    n, length = a.batch + 2, a.context
    if a.shape != "model":
        g, warm = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
        return ([torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(a.batch)],
                [torch.randint(1, vocab, (256,), generator=warm).tolist() for _ in range(2)])
    import reference_corpus

    from o3edge.engine.tokenizer import Tokenizer

    tok, ids = Tokenizer(path), []
    # held-out stdlib docstrings: every machine has them (the documentation sources are an extra package)
    for text in reference_corpus.split(reference_corpus.load(None, ("stdlib",)))[2].values():
        ids += tok.encode(text, add_special_tokens=False)
    stride, text = max(1, len(ids) // n), ids * (length // len(ids) + 2)  # wrapped round once, for every window
    windows = [text[i * stride:i * stride + length] for i in range(n)]
    return windows[:a.batch], [w[:256] for w in windows[a.batch:]]


def decode_checkpoint(a) -> tuple[str, list, list]:
    """(checkpoint, prompts, warm-up prompts) of a decode run (--gpu, and the tools that profile its steps):
    --shape's random weights (made in --workdir once), or with --shape model --model's checkpoint (default:
    the built-in reference model); gpu_prompts' prompts for it."""
    from make_tiny_model import SHAPES

    from o3edge.tiny import make_checkpoint

    if a.shape == "model":
        path = resolve_model_path(a.model)
    else:
        path = os.path.join(a.workdir, a.shape)
        if not os.path.exists(os.path.join(path, "config.json")):
            make_checkpoint(path, **SHAPES[a.shape])
    with open(os.path.join(path, "config.json")) as fh:
        return (path, *gpu_prompts(path, a, json.load(fh)["vocab_size"]))


def decode_engine(path: str, label: str, device: str, dtype: str, threads: int | None, a, **kw) -> LLMEngine:
    """An engine for --batch sequences of --context tokens and --steps new ones: blocks for the whole batch
    at full precision, plus a tenth (the router's scale tables come out of the same budget, and a setting
    that demotes nothing, on random weights, must not preempt either)."""
    budget = (a.batch * (a.context + a.steps + 64) // 32 + 8) * 11 // 10
    return engine(path, label, device, dtype, threads, num_kv_blocks=budget, max_num_seqs=a.batch,
                  max_model_len=a.context + a.steps + 64, max_num_batched_tokens=a.context, **kw)


def uncaptured_graphs(eng: LLMEngine, batch: int):
    """Give eng the decode graph steps uncaptured, launched ahead (as the CPU tests run them): the
    router's when it has one. Returns them."""
    from o3edge.engine.cuda_graph import DecodeGraphs
    from o3edge.engine.router_graph import RouterDecodeGraphs

    graphs_cls = RouterDecodeGraphs if eng.runner.router is not None else DecodeGraphs
    eng.runner.graphs = graphs_cls(eng.runner, batch, capture=False, launch_ahead=True)
    return eng.runner.graphs


def step_kind(router, last: str | None) -> str:
    """What the next engine step is for the router (None: off), given the last one's kind: a refresh (it
    observes), the step after one (it reads the saliency and plans the refresh's demotions), a step that
    carries out a share of them (KVRouter.make_due), or another."""
    if router is None:
        return "other"
    if router.observing_now():
        return "refresh"
    if last == "refresh":
        return "after refresh"
    return "demoting" if router.pending or router.due else "other"


def by_kind(walls: dict) -> dict:
    """{step kind: its count and median wall ms} of {step kind: [wall ms of each step]}."""
    return {k: {"n": len(v), "median_ms": round(statistics.median(v), 4)} for k, v in walls.items()}


def prefilling(eng) -> bool:
    """Whether eng has a prompt still to prefill: a request waiting, or running without its first token."""
    return any(s.num_output_tokens == 0 for s in eng.scheduler.running) or bool(eng.scheduler.waiting)


def decode_once(path, prompts, warm, label: str, graphs: bool, a) -> dict:
    """One setting's decode on the GPU: a short warm-up generation, the prompts prefilled (one a step: the
    median prompt step's wall time), then tok/s of the batch once every prompt is in, the steps' wall times
    (p50/p90/p99, by step kind) and the KV books."""
    eng = decode_engine(path, label, "cuda", "bfloat16", None, a, cuda_graphs=graphs, router_cuda_graphs=graphs)
    for i, ids in enumerate(warm):  # a short generation first: the first refresh step's kernels load
        eng.add_request(f"warm-up {i}", ids, SamplingParams(max_new_tokens=40, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    graph_path = eng.runner.graphs
    if graph_path is not None:
        graph_path.num_steps = graph_path.num_ahead_taken = 0
    for i, ids in enumerate(prompts):
        eng.add_request(str(i), ids, SamplingParams(max_new_tokens=a.steps, ignore_eos=True))
    prompt_steps = []  # one prompt a step (max_num_batched_tokens is the context): each ends synchronized
    while prefilling(eng):
        t = time.perf_counter()
        eng.step()  # prefill everything (the first tokens)
        prompt_steps.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    demoted = getattr(eng.blocks, "num_demoted", 0)
    t0, n, steps, kinds, kind = time.perf_counter(), 0, [], {}, None
    while eng.has_unfinished_requests():
        kind = step_kind(eng.runner.router, kind)
        t = time.perf_counter()
        _, rep = eng.step()  # returns its tokens to the host: each step ends synchronized
        steps.append((time.perf_counter() - t) * 1e3)
        kinds.setdefault(kind, []).append(steps[-1])
        n += sum(generated for _, generated in rep.tokens.values()) if rep else 0
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    st = eng.stats()
    q = torch.tensor(steps).quantile(torch.tensor([0.5, 0.9, 0.99])).tolist()
    row = {"decode_tokens_per_s": round(n / dt, 1), "decode_tokens": n,
           "kv_bytes_per_token": st.get("kv_bytes_per_token"),
           "compressed_share": st.get("kv_tokens_compressed_share", 0.0),
           "preemptions": st.get("preemptions"),
           "blocks_demoted_in_decode": getattr(eng.blocks, "num_demoted", 0) - demoted,
           "prompt_step_ms_p50": round(statistics.median(prompt_steps), 3),
           "steps": len(steps), "step_ms_p50": round(q[0], 3),
           "step_ms_p90": round(q[1], 3), "step_ms_p99": round(q[2], 3), "step_ms_max": round(max(steps), 3),
           "step_ms_sum_top_16th": round(sum(sorted(steps)[-max(1, len(steps) // 16):]), 2),
           "by_kind": by_kind(kinds)}  # the router's refresh steps, the steps after them, ...
    if graph_path is not None:  # steps taken from the launch-ahead queue, of the graph steps
        row.update(graph_steps=graph_path.num_steps, steps_launched_ahead=graph_path.num_ahead_taken)
        if graph_path.capture:
            row.update(replay_ms(graph_path, a.batch))
    del eng
    free_device_memory()
    return row


def replay_ms(graphs, batch: int, n: int = 200) -> dict:
    """The device's time for one decode step alone: the last step's graph (and the router's observing one)
    replayed n times back to back, timed by CUDA events, once the decode is over (its metadata and tables
    as that step left them; the K/V the replays write go to slots nothing reads after). The host launches
    a replay in a few microseconds, so the queue stays full and the figure is the GPU's step, which a step
    of the whole engine cannot go below however light its host work: the half of a step the router's
    fewer bytes can shorten."""
    B = next(b for b in graphs.batch_buckets if b >= batch)
    out = {}
    observe = getattr(graphs, "observe_graphs", {})
    for name, table in (("graph_replay_ms", graphs.graphs), ("observe_replay_ms", observe)):
        if (B, 0) not in table:
            continue
        graph = table[(B, 0)][0]
        graph.replay()  # its first replay since the decode
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        end.synchronize()
        out[name] = round(start.elapsed_time(end) / n, 4)
    return out


def over_rounds(rounds: list[dict], off: list[dict]) -> dict:
    """One setting's rounds (decode_once rows, in the order run) beside full precision's of the same
    rounds: the median tok/s and each round's ratio to full precision, with every round's row kept."""
    tok_s = [r["decode_tokens_per_s"] for r in rounds]
    ratios = [r["decode_tokens_per_s"] / o["decode_tokens_per_s"] for r, o in zip(rounds, off)]
    return {**rounds[0], "decode_tokens_per_s": round(statistics.median(tok_s), 1),
            "ratio_to_off_by_round": [round(x, 3) for x in ratios],
            "ratio_to_off_median": round(statistics.median(ratios), 3), "rounds": rounds}


def summary_line(name: str, row: dict) -> str:
    """One setting's --gpu row in a line: tok/s (with rounds: the median, and the ratio to full precision by
    round), the GPU step alone, the KV bytes a token, the blocks demoted while decoding and the median step
    by kind (the lines a GPU call's script shows)."""
    speed = f"{row['decode_tokens_per_s']} tok/s"
    if "ratio_to_off_by_round" in row:
        speed = (f"median {speed}, {row['ratio_to_off_median']}x of full precision "
                 f"(by round {row['ratio_to_off_by_round']})")
    kinds = {kind: v["median_ms"] for kind, v in row.get("by_kind", {}).items()}
    return (f"{name}: {speed}; GPU step {row.get('graph_replay_ms')} ms, {row.get('kv_bytes_per_token')} KV bytes a "
            f"token, {row.get('blocks_demoted_in_decode')} blocks demoted, median step ms by kind {kinds}")


def gpu_runs(labels: list[str], eager: bool, off_last: bool = False) -> list[tuple[str, str, bool]]:
    """A round's runs, in order, as (row name, setting, CUDA graphs): full precision first, then the other
    settings as given (off_last: full precision last instead, to see whether a setting's place in the round
    moves its speed); with eager, the same again without graphs."""
    labels = [x for x in labels if x != "off"]
    runs = []
    for graphs, off_name, suffix in ((True, "off (CUDA graphs)", " (CUDA graphs)"), (False, "off (eager)", "")):
        if graphs or eager:
            off, rest = [(off_name, "off", graphs)], [(label + suffix, label, graphs) for label in labels]
            runs += rest + off if off_last else off + rest
    return runs


def gpu(a) -> dict:
    """Decode speed of each setting on the GPU. With --rounds N, every setting runs N times, the settings
    alternating round by round (off first in each; last with --off-last), so that a machine whose speed
    drifts between runs (a small model's step is mostly host time) moves every setting alike; rows then
    report the median tok/s and each round's ratio to full precision in that round."""
    path, prompts, warm = decode_checkpoint(a)  # the same prompts for every setting, made once
    runs = gpu_runs(labels_of(a), a.eager, a.off_last)
    measured: dict[str, list] = {}
    for r in range(a.rounds):
        for name, label, graphs in runs:
            measured.setdefault(name, []).append(decode_once(path, prompts, warm, label, graphs, a))
            print(name if a.rounds == 1 else f"{name} round {r + 1}", measured[name][-1], flush=True)
    if a.rounds == 1:
        rows = {name: rounds[0] for name, rounds in measured.items()}
    else:
        off = {True: measured["off (CUDA graphs)"], False: measured.get("off (eager)")}
        rows = {name: over_rounds(rounds, off[name.endswith("(CUDA graphs)")]) for name, rounds in measured.items()}
    for name, row in rows.items():
        print(summary_line(name, row), flush=True)
    return {"mode": "gpu-decode", "shape": a.shape, "context": a.context, "batch": a.batch, "steps": a.steps,
            "rounds": a.rounds, "device": torch.cuda.get_device_name(), "results": rows}


def capacity(a) -> dict:
    """The same KV budget with and without the router: --capacity-seqs held-out prompts of
    --prompt-tokens tokens, --new-tokens each, all queued at once on an engine whose pool holds
    --capacity-budget sequences' worth of full-precision blocks. Reports the peak and mean number of
    sequences running, preemptions and engine steps, and the engine's own KV stats at the peak."""
    model_dir = resolve_model_path(a.model)
    rows, where = {}, None
    for label in labels_of(a):
        probe = engine(model_dir, "off", a.device, a.dtype, a.threads, cuda_graphs=False)
        where = where or device_info(probe, a.threads)
        prompts, _ = held_out(probe.tokenizer, a.capacity_seqs, a.prompt_tokens)
        length = a.prompt_tokens + a.new_tokens
        blocks = int(a.capacity_budget * -(-length // probe.config.kv_block_size))
        del probe
        eng = engine(model_dir, label, a.device, a.dtype, a.threads, num_kv_blocks=blocks,
                     max_num_seqs=a.capacity_seqs)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True))
        t0, steps, running, peak, at_peak = time.perf_counter(), 0, [], 0, {}
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
            n = len(eng.scheduler.running)
            running.append(n)
            if n > peak:
                peak, at_peak = n, {k: v for k, v in eng.stats().items() if k.startswith("kv_")}
        st = eng.stats()
        rows[label] = {"num_kv_blocks_budget": blocks, "full_precision_blocks": eng.blocks.num_blocks,
                       "peak_running": peak, "mean_running": round(sum(running) / len(running), 2),
                       "preemptions": st["preemptions"], "steps": steps, "kv_stats_at_peak": at_peak,
                       "seconds": round(time.perf_counter() - t0, 1)}
        print(label, rows[label], flush=True)
        del eng
        free_device_memory()
    return {"mode": f"{where['device'].split(':')[0]}-capacity", **where,
            "model": os.path.basename(model_dir), "sequences": a.capacity_seqs,
            "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
            "budget_sequences_full_precision": a.capacity_budget, "settings": SETTINGS, "results": rows}


def generate_all(eng: LLMEngine, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """(seconds to generate `new` tokens from each prompt, all queued at once; seconds until every prompt had
    its first token), timed from outside the engine."""
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"s{i}-{new}-{t0}", p, SamplingParams(max_new_tokens=new, ignore_eos=True))
    started, first = set(), None
    while eng.has_unfinished_requests():
        outputs, _ = eng.step()
        started.update(o.request_id for o in outputs if o.token_ids)
        if first is None and len(started) == len(prompts):
            first = time.perf_counter() - t0
    return time.perf_counter() - t0, first


def speed(a) -> dict:
    """Prefill and decode speed on --device, every setting on the torch engine, timed from outside it: --prompts
    held-out prompts of --prompt-tokens at once generating one token each (the prefill, the prompt's routing
    included), then --prompts other held-out prompts (no prefix reuse) generating --new-tokens each; decode
    tokens/s is the tokens after the first over the time after the last first token, in that same run (the
    prefill run's time subtracted instead went negative on a loaded machine). --rounds N runs every setting
    N times, alternating."""
    model_dir = resolve_model_path(a.model)
    labels = ["off"] + [x for x in labels_of(a) if x != "off"]
    rows, where = {label: [] for label in labels}, None
    for _ in range(a.rounds):
        for label in labels:
            eng = engine(model_dir, label, a.device, a.dtype, a.threads, cuda_graphs=False)
            where = where or device_info(eng, a.threads)
            prompts, _ = held_out(eng.tokenizer, 2 * a.prompts + 1, a.prompt_tokens)
            generate_all(eng, prompts[-1:], 2)  # warm-up
            prefill, _ = generate_all(eng, prompts[:a.prompts], 1)
            whole, first = generate_all(eng, prompts[a.prompts:2 * a.prompts], a.new_tokens)
            row = {"prefill_s": round(prefill, 3), "whole_s": round(whole, 3),
                   "decode_tokens_per_s": round(a.prompts * (a.new_tokens - 1) / (whole - first), 1),
                   "blocks_demoted": getattr(eng.blocks, "num_demoted", 0)}
            rows[label].append(row)
            print(label, row, flush=True)
            del eng
            free_device_memory()
    results = {}
    for label, runs in rows.items():
        mid = {k: statistics.median(r[k] for r in runs) for k in ("prefill_s", "decode_tokens_per_s")}
        results[label] = {"median_prefill_s": round(mid["prefill_s"], 3),
                          "median_decode_tokens_per_s": round(mid["decode_tokens_per_s"], 1), "runs": runs}
    for label, res in results.items():
        off = results["off"]
        res["prefill_vs_off"] = round(res["median_prefill_s"] / off["median_prefill_s"], 2)
        res["decode_vs_off"] = round(res["median_decode_tokens_per_s"] / off["median_decode_tokens_per_s"], 2)
        print(f"{label}: prefill {res['median_prefill_s']} s ({res['prefill_vs_off']}x off's time), decode "
              f"{res['median_decode_tokens_per_s']} tok/s ({res['decode_vs_off']}x off's)", flush=True)
    return {"mode": f"{where['device'].split(':')[0]}-speed", **where, "model": os.path.basename(model_dir),
            "prompts": a.prompts, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
            "rounds": a.rounds, "settings": {k: SETTINGS[k] for k in labels}, "results": results}


def save(a, r: dict, partial: bool = False) -> None:
    """Write r to --json (if given) with the run's date and versions; partial: not every setting yet."""
    if not a.json:
        return
    r = dict(r, date=datetime.date.today().isoformat(), machine=platform.machine(),
             python=platform.python_version(), torch=torch.__version__)
    if partial:
        r["partial"] = True
    tmp = a.json + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(r, fh, indent=1)
    os.replace(tmp, a.json)


def table(r: dict) -> str:
    n = r.get("new_tokens", 256)
    lines = ["| KV setting | KV bytes/token (bf16 storage) | vs bf16 | tokens kept full precision "
             f"| mean KL vs off (nats) | top-1 agreement (teacher-forced) | greedy agreement, {n} tokens "
             f"| greedy tokens until first divergence (of {n}) | pass key found | passage copy (of 16) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, x in r["results"].items():
        until = x.get("greedy_tokens_until_divergence")  # absent from results recorded before it was added
        lines.append(f"| {label} | {x['kv_bytes_per_token_bf16']:.0f} | {x['kv_bytes_vs_bf16']:.3f} "
                     f"| {x['full_precision_token_share']:.1%} | {x['mean_kl_nats']:.5f} "
                     f"| {x['top1_agreement_forced']:.2%} | {x['greedy_agreement_free']:.2%} "
                     f"| {'n/a' if until is None else f'{until:.1f}'} "
                     f"| {x['needle_found']:.0%} | {x['copy_tokens_mean']:.2f} |")
    return "\n".join(lines)


def plot(r: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (label, x) in enumerate(r["results"].items()):
        kl = max(x["mean_kl_nats"], 1e-7)
        for a_, y, up in ((ax, kl, 5), (ax2, 100 * x["greedy_agreement_free"], 5 - 11 * (i % 3))):
            a_.scatter(x["kv_bytes_vs_bf16"], y, s=40)
            a_.annotate(label, (x["kv_bytes_vs_bf16"], y), textcoords="offset points", xytext=(5, up), fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("mean KL vs off, nats (off drawn at 1e-7)")
    ax2.set_ylabel(f"greedy tokens identical to off's, % of {r.get('new_tokens', 256)}")
    for a_ in (ax, ax2):
        a_.set_xlabel("KV bytes per token, relative to bf16")
        a_.grid(True, alpha=0.3)
    fig.suptitle(f"Token router, {os.path.basename(r['model'])} on {r.get('device_name', r.get('device'))}, "
                 f"{r.get('dtype')}: quality against KV memory, one run", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def add_settings(a) -> None:
    """Add to SETTINGS the ones a's switches ask for (--tuned, --blocks, --thresholds, --refresh-steps, --floor)."""
    if a.tuned:
        SETTINGS.update(TUNED)
    if a.blocks:
        SETTINGS.update(BLOCKS)
    for t in filter(None, a.thresholds.split(",")):
        SETTINGS.update({f"router-{kv}-t{t}": dict(TUNED[f"router-{kv}-tuned"], router_threshold=float(t))
                         for kv in ("int8", "int4")})
    if a.refresh_steps:  # the default routers and --thresholds' ones, refreshing every N steps
        SETTINGS.update({f"{name}-refresh{a.refresh_steps}": dict(setting, router_refresh_steps=a.refresh_steps)
                         for name, setting in list(SETTINGS.items())
                         if name in ("router-int8", "router-int4")
                         or name.startswith(("router-int8-t", "router-int4-t"))})
    if a.floor:
        SETTINGS.update(FLOOR)
        if a.gpu:
            SETTINGS.update(FLOOR_GPU)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in reference model)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=640)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--needle-lengths", default="256,512,896")
    ap.add_argument("--needle-depths", default="0.1,0.5,0.9")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--device", default="cpu", help="quality, --capacity: cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"),
                    help="quality, --capacity: the engine's dtype (weights, activations, full-precision KV)")
    ap.add_argument("--tuned", action="store_true", help="also the router with threshold 0.5 and 32 recent tokens")
    ap.add_argument("--thresholds", default="",
                    help="also the tuned routers (4 sink, 32 recent tokens) at these thresholds "
                         "(comma-separated: router-int8-t0.4, router-int4-t0.4, ...)")
    ap.add_argument("--refresh-steps", type=int, default=0,
                    help="also the routers refreshing every N decode steps (router-int8-refreshN, -int4-refreshN, and "
                         "with --thresholds router-int8-t0.3-refreshN, ...)")
    ap.add_argument("--floor", action="store_true",
                    help="also router-keep-all: the router's path, nothing compressed (the path's own distance from off)")
    ap.add_argument("--capacity", action="store_true", help="sequences at once in a fixed KV budget (on --device)")
    ap.add_argument("--capacity-seqs", type=int, default=8)
    ap.add_argument("--only", default=None, help="these settings (comma-separated labels; quality always runs off)")
    ap.add_argument("--capacity-budget", type=float, default=3.0, help="full-precision sequences the pool holds")
    ap.add_argument("--gpu", action="store_true", help="decode speed on the GPU (random weights) instead of quality")
    ap.add_argument("--speed", action="store_true",
                    help="prefill and decode speed of --model on --device (the torch engine, no CUDA graphs)")
    ap.add_argument("--shape", default="llama-1b",
                    help="--gpu: a make_tiny_model.py shape (random weights), or `model`: --model's checkpoint "
                         "on held-out stdlib docstrings")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--eager", action="store_true", help="--gpu: also every setting without CUDA graphs")
    ap.add_argument("--off-last", action="store_true",
                    help="--gpu: full precision last in each round instead of first (does the order move it?)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="--gpu: every setting this many times, alternating; medians and ratios by round")
    ap.add_argument("--blocks", action="store_true",
                    help="add router-int8-blocks and router-int4-blocks (router_select = \"blocks\")")
    ap.add_argument("--workdir", default="/tmp/o3edge-bench-router")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--from-json", default=None, help="only redraw --plot from a saved quality run's JSON")
    a = ap.parse_args(argv)
    if a.from_json:
        if not a.plot:
            ap.error("--from-json redraws a plot: give --plot OUT.png")
        with open(a.from_json) as f:
            plot(json.load(f), a.plot)
        return
    torch.manual_seed(0)
    add_settings(a)
    r = gpu(a) if a.gpu else capacity(a) if a.capacity else speed(a) if a.speed else quality(a)
    if not a.gpu and not a.capacity and not a.speed:
        print(table(r))
        if a.plot:
            plot(r, a.plot)
    save(a, r)


if __name__ == "__main__":
    main()
