#!/usr/bin/env python3
"""Does calibrated INT4 (searched scales, GPTQ) keep INT4 attention projections and LM head within the goal?

  python tools/eval_int4_calibrated.py [--tokens 10000] [--methods rtn mse gptq gptq-mse]
                                       [--scopes ffn +head +attn all] [--group 32] [--calib-tokens 65536]
                                       [--calib-text docs|docstrings|sources] [--no-sequential] [--threads 1]

Scores the held-out windows of tools/eval_reference.py (reference model, 512-token windows) with the FP32
engine and the cpu-int4 preset (FFN INT4 g32 by round to nearest, attention projections and LM head INT8),
whose layers are then swapped in-process for INT4 ones quantized from the FP32 weights by each method of
o3edge/engine/gptq.py: scope ffn = the preset's own INT4 layers, +head = and the LM head, +attn = and
the attention projections, all = every linear. GPTQ's Hessians come from --calib-tokens tokens of the
TRAINING split's documentation pages (never the held-out pages scored here), in 512-token windows.
Prints perplexity, mean KL from FP32 and top-1 agreement per variant, and each calibration's time.
An experiment for issue 13.
"""
import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import torch  # noqa: E402

import eval_reference as ev  # noqa: E402
import reference_corpus  # noqa: E402
from o3edge.engine import gptq  # noqa: E402
from o3edge.engine.engine_dir import build_engine_dir  # noqa: E402
from o3edge.engine.quant import Int4Linear  # noqa: E402

MODEL = "o3edge/models/o3edge-ref"
WINDOW = 512


def calibration_windows(tokenizer, num_tokens: int, window: int, source: str = "docs", seed: int = 0):
    """Windows of training-split documentation pages (pages in a seeded random order), or of the texts
    the standard library's (gptq.calibration_texts: "docstrings", what `o3edge build` calibrates with, or "sources")."""
    if source in ("docstrings", "sources"):
        return gptq.calibration_windows(tokenizer, num_tokens, window, gptq.calibration_texts(source))
    train, _, _ = reference_corpus.split(reference_corpus.load(None, ("docs",)))
    pages = sorted(train)
    random.Random(seed).shuffle(pages)
    eot = tokenizer.token_id("<|endoftext|>")
    ids: list[int] = []
    for page in pages:
        ids += tokenizer.encode(train[page], add_special_tokens=False) + [eot]
        if len(ids) >= num_tokens:
            break
    return [ids[i:i + window] for i in range(0, min(len(ids), num_tokens) - window + 1, window)]


def scope_names(scope: str, num_layers: int) -> list[str]:
    ffn = [f"layers.{i}.mlp.{p}" for i in range(num_layers) for p in ("gate_up", "down")]
    attn = [f"layers.{i}.attn.{p}" for i in range(num_layers) for p in ("qkv", "o")]
    return {"ffn": ffn, "+head": ffn + ["lm_head"], "+attn": ffn + attn, "all": ffn + attn + ["lm_head"]}[scope]


def swap(engine, fpm, tensors: dict, group: int):
    model = engine.runner.model
    for name, (qweight, sz) in tensors.items():
        parent, _, attr = name.rpartition(".")
        N, K = gptq._weight(fpm, name).shape
        mod = Int4Linear(K, N, group)
        mod.load_quantized(qweight, sz)
        setattr(model.get_submodule(parent) if parent else model, attr, mod)
    return engine


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=10000)
    ap.add_argument("--methods", nargs="*", default=list(gptq.METHODS), choices=gptq.METHODS)
    ap.add_argument("--scopes", nargs="*", default=["ffn", "+head", "+attn", "all"])
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--calib-tokens", type=int, default=65536)
    ap.add_argument("--calib-text", default="docs", choices=("docs", "docstrings", "sources"),
                    help="docs: training-split documentation pages; docstrings (what `o3edge build` calibrates on) "
                         "or sources: gptq.calibration_texts")
    ap.add_argument("--no-sequential", action="store_true", help="every Hessian from the FP32 model")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    fp = ev.make_engine(MODEL, "float32", None, WINDOW)
    fpm = fp.runner.model
    wins = ev.held_out_windows(fp.tokenizer, None, a.tokens, WINDOW)
    calib = calibration_windows(fp.tokenizer, a.calib_tokens, WINDOW, a.calib_text)
    out = os.path.join(tempfile.mkdtemp(), "int4")
    build_engine_dir(MODEL, out, torch.float32, None, preset="cpu-int4")
    engines = {}
    for method in a.methods:
        for scope in a.scopes:
            t0 = time.perf_counter()
            names = scope_names(scope, fpm.args.num_layers)
            tensors = gptq.calibrate(fpm, calib, names, a.group, method, sequential=not a.no_sequential)
            label = f"{method} {scope} g{a.group}"
            print(f"# {label}: quantized {len(names)} linears in {time.perf_counter() - t0:.1f} s", flush=True)
            engines[label] = swap(ev.make_engine(out, "preset:" + out, None, WINDOW), fpm, tensors, a.group)
    tallies = {k: ev.Tally() for k in engines}
    fpt = ev.Tally()
    for ids in wins:
        ref = fp.score(ids)
        fpt.add(ref.float(), ref, ids)
        for k, e in engines.items():
            tallies[k].add(e.score(ids).float(), ref, ids)
    print(f"# {len(wins) * WINDOW} held-out tokens in {len(wins)} windows; calibration {len(calib)} windows "
          f"({sum(map(len, calib))} tokens of {a.calib_text} text), sequential={not a.no_sequential}")
    fp32 = fpt.row()["ppl"]
    print(f"{'variant':<22} {'ppl':>8} {'vs FP32':>8} {'KL':>8} {'top-1':>7}")
    for k, t in [("FP32", fpt)] + list(tallies.items()):
        r = t.row()
        print(f"{k:<22} {r['ppl']:8.3f} {100 * (r['ppl'] / fp32 - 1):+7.2f}% {r['kl']:8.4f} {100 * r['top1']:6.2f}%",
              flush=True)


if __name__ == "__main__":
    main()
