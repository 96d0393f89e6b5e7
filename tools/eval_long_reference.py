#!/usr/bin/env python3
"""Reference models side by side: held-out perplexity, pass-key retrieval, chat answers, on o3edge's engine.

  python tools/eval_long_reference.py --model o3edge/models/o3edge-ref OUT_DIR [--device cpu|cuda]
        [--ppl-tokens 20000] [--ppl-window 512] [--passkey-per-cell 2] [--chat-pairs 100]
        [--json results.json] [--write docs/benchmarks.md]

For each model (full-precision KV, no router): perplexity of the held-out documentation pages
(tools/reference_corpus.py) in --ppl-window windows; pass-key accuracy by length (512, 1K, 2K, 4K;
lengths past the model's window are "n/a") and depth, filler from the held-out documents, pages
and docstrings (tools/passkey.py, tools/skills_eval.py); chat accuracy on held-out documentation names
(tools/doc_qa.py: the trainer never saw their Q/A pairs), asked as a ChatML user turn, greedy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import sys
import time

import torch

TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TOOLS)
sys.path.insert(0, REPO)
sys.path.insert(0, TOOLS)

import doc_qa  # noqa: E402
import eval_reference  # noqa: E402
import reference_corpus  # noqa: E402
import skills_eval  # noqa: E402
from o3edge import O3Config, O3Model  # noqa: E402
from o3edge.engine.sequence import SamplingParams  # noqa: E402
from o3edge.model_path import resolve_model_path  # noqa: E402

log = logging.getLogger("eval_long_reference")
SECTION = "## Reference models: long context, retrieval and chat"


def model_for(model_dir: str, device: str, dtype: str) -> O3Model:
    return O3Model.from_config(O3Config(model_path=model_dir, device=device, dtype=dtype, max_num_seqs=1,
                                        num_kv_blocks=4096 // 32 + 4, dynamic_kv_cache=False))


def generator(model: O3Model):
    """generate(ids, n) -> greedy new ids, stopping at the model's end tokens."""
    return lambda ids, n: model.generate_batch([list(ids)], SamplingParams(max_new_tokens=n))[0].token_ids


def held_out_ids(tok, docs: dict[str, str]) -> list[int]:
    """Held-out documents as one token stream (pass-key filler)."""
    _, _, held = reference_corpus.split(docs)
    ids: list[int] = []
    for text in held.values():
        ids += tok.encode(text, add_special_tokens=False)
    return ids


def evaluate(model_dir: str, a, docs: dict[str, str], held_pairs: list) -> dict:
    t0 = time.time()
    model = model_for(model_dir, a.device, a.dtype)
    eng, window = model.engine, model.engine.info.max_model_len
    # how fast it starts: the engine's load, and the first request's first token (nothing warmed before it)
    first = model.generate("The json module", max_new_tokens=8)
    start = {"load_s": eng.info.load_seconds, "first_ttft_ms": first.ttft_s * 1e3}
    tok = eng.tokenizer
    wins = eval_reference.held_out_windows(tok, a.data, a.ppl_tokens, min(a.ppl_window, window - 1))
    nll = count = 0
    for ids in wins:
        logits = eng.score(ids).float()
        nll += torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:], device=logits.device),
                                                 reduction="sum").item()
        count += len(ids) - 1
    gen = generator(model)
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    dec = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    pk = skills_eval.passkey_accuracy(gen, enc, dec, held_out_ids(tok, docs), window, a.lengths,
                                      per_cell=a.passkey_per_cell)
    chat = skills_eval.chat_accuracy(gen, enc, dec, held_pairs[:a.chat_pairs])
    row = {"model": model_dir, "window": window, "ppl": math.exp(nll / count), "ppl_tokens": count,
           "ppl_window": len(wins[0]), "passkey": pk, "chat": chat, **start, "seconds": time.time() - t0}
    log.info("%s: ppl %.3f, pass key %s, chat exact %.1f%% F1 %.3f", model_dir, row["ppl"], pk["by_length"],
             100 * chat["exact"], chat["f1"])
    return row


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def table(rows: list[dict], meta: dict) -> str:
    lengths = meta["lengths"]
    lines = [SECTION, "", f"`{meta['command']}` ({meta['date']}, {meta['device']}, full-precision KV, greedy).",
             "Perplexity: held-out documentation pages; pass key: held-out filler, depths "
             + ", ".join(f"{d:g}" for d in skills_eval.DEPTHS) + f", {meta['per_cell']} keys each; chat: "
             f"held-out names (their Q/A pairs never trained on), exact = the documented first sentence word "
             "for word.", "",
             "| model | window | held-out ppl | " + " | ".join(f"pass key {L}" for L in lengths)
             + " | chat exact | chat word F1 | load, first token |",
             "|---|---:|---:|" + "---:|" * len(lengths) + "---:|---:|---:|"]
    for r in rows:
        pk = r["passkey"]["by_length"]
        lines.append(f"| `{r['model']}` | {r['window']} | {r['ppl']:.2f} ({r['ppl_window']}-token windows) | "
                     + " | ".join(_pct(pk.get(L)) for L in lengths)
                     + f" | {_pct(r['chat']['exact'])} of {r['chat']['n']} | {r['chat']['f1']:.3f} | "
                     f"{r['load_s']:.2f} s, {r['first_ttft_ms']:.1f} ms |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=[None], help="checkpoint directories (default: the built-in)")
    ap.add_argument("--data", default=None, help="packed corpus; default: .corpus/ or the local python3.X-doc")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ppl-tokens", type=int, default=20000)
    ap.add_argument("--ppl-window", type=int, default=512)
    ap.add_argument("--passkey-per-cell", type=int, default=2)
    ap.add_argument("--lengths", default=",".join(map(str, skills_eval.LENGTHS)), help="pass-key lengths")
    ap.add_argument("--chat-pairs", type=int, default=100, help="held-out names asked (the first N)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--write", default=None, help="markdown file to put the table in (docs/benchmarks.md)")
    a = ap.parse_args(argv)
    a.lengths = [int(x) for x in a.lengths.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    torch.set_num_threads(a.threads)
    docs = reference_corpus.load(a.data, ("docs", "stdlib"))
    train_docs, _, _ = reference_corpus.split(docs)
    held_pairs = doc_qa.split(doc_qa.pairs(train_docs))[2]
    rows = [evaluate(resolve_model_path(m), a, docs, held_pairs) for m in a.model]
    meta = dict(command="python tools/eval_long_reference.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                date=datetime.date.today().isoformat(), device=a.device, per_cell=a.passkey_per_cell,
                lengths=a.lengths)
    section = table(rows, meta)
    print(section)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    if a.write:
        eval_reference.write_section(a.write, section, SECTION)
    return rows


if __name__ == "__main__":
    main()
