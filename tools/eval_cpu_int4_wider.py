#!/usr/bin/env python3
"""Would INT4 attention projections or an INT4 LM head keep the cpu-int4 preset within the precision goal?

  python tools/eval_cpu_int4_wider.py [TOKENS]

Scores the held-out windows of tools/eval_reference.py (reference model, 512-token windows) with the FP32
engine, the cpu-int4 preset, and the preset with its INT8 layers swapped in-process for INT4 ones
(asymmetric, group 32 or 64, quantized from the FP32 weights; o3edge's VNNI INT4 kernel). Prints
perplexity, mean KL from FP32 and top-1 agreement per variant. A one-off experiment for issue 13.
"""
import os, sys, tempfile
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import torch
import eval_reference as ev
from o3edge.engine.engine_dir import build_engine_dir
from o3edge.engine.quant import Int4Linear, quantize_int4
model_dir = "o3edge/models/o3edge-ref"
window = 512
fp = ev.make_engine(model_dir, "float32", None, window)
wins = ev.held_out_windows(fp.tokenizer, None, int(sys.argv[1]) if len(sys.argv) > 1 else 20000, window)
tmp = tempfile.mkdtemp(); out = os.path.join(tmp, "int4")
build_engine_dir(model_dir, out, torch.float32, None, preset="cpu-int4")
fpm = fp.runner.model
def swap(engine, names, G=32):
    m = engine.runner.model
    for name in names:
        parent, _, attr = name.rpartition(".")
        src = fpm.get_submodule(name) if name != "lm_head" or fpm.lm_head is not None else None
        w = src.weight if src is not None else fpm.embed.weight
        mod = Int4Linear(w.shape[1], w.shape[0], G)
        mod.load_quantized(*quantize_int4(w.detach().float(), G))
        setattr(m.get_submodule(parent) if parent else m, attr, mod)
    return engine
L = fpm.args.num_layers
attn = [f"layers.{i}.attn.{p}" for i in range(L) for p in ("qkv", "o")]
variants = {"cpu-int4": [], "+head int4 g32": ["lm_head"], "+attn int4 g32": attn, "+both g32": attn + ["lm_head"],
            "+both g64": (attn + ["lm_head"], 64)}
engines = {}
for k, v in variants.items():
    names, G = v if isinstance(v, tuple) else (v, 32)
    engines[k] = swap(ev.make_engine(out, "preset:" + out, None, window), names, G)
tallies = {k: ev.Tally() for k in engines}
for ids in wins:
    ref = fp.score(ids)
    for k, e in engines.items():
        tallies[k].add(e.score(ids).float(), ref, ids)
fpt = ev.Tally()
for ids in wins: fpt.add(fp.score(ids).float(), fp.score(ids), ids)
print("FP32", fpt.row())
for k, t in tallies.items(): print(k, t.row())
