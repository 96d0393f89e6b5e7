#!/usr/bin/env python3
"""Held-out quality of the reference model under each engine precision, against FP32 and transformers.

  python tools/eval_reference.py [--model DIR] [--tokens 20000] [--window 512] [--write docs/benchmarks.md]
                                 [--preset cpu-int8 cpu-int4] [--native] [--only FP32 ...]

The held-out documentation pages of tools/reference_corpus.py (never trained on) are tokenized,
joined by <|endoftext|>, cut to --tokens and split into windows of --window tokens. Every engine
scores the same windows with LLMEngine.score; each window's first token has no context and is not
scored. Besides perplexity, each row gives its mean KL divergence from the FP32 engine and how
often its top-1 token agrees with FP32's. Transformers (FP32) scores the same windows as the oracle.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import platform
import re
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TOOLS)
sys.path.insert(0, REPO)
sys.path.insert(0, TOOLS)

import reference_corpus  # noqa: E402
from machine_info import cpu_name  # noqa: E402
from o3edge.config import O3Config  # noqa: E402
from o3edge.engine.engine import LLMEngine  # noqa: E402
from o3edge.model_path import resolve_model_path  # noqa: E402

log = logging.getLogger("eval_reference")
SECTION = "## Reference model: held-out quality by engine precision"
INT4_GROUPS = (32, 64, 128)

# (label, dtype, INT4 group size or None[, more O3Config settings]); FP32 first: the reference for KL and agreement
VARIANTS = [("FP32", "float32", None), ("FP16", "float16", None), ("BF16", "bfloat16", None)]
VARIANTS += [(f"INT4-FFN g{g} + BF16", "bfloat16", g) for g in INT4_GROUPS]
VARIANTS += [(f"INT4-FFN g{g} + FP32", "float32", g) for g in INT4_GROUPS]
VARIANTS += [(f"INT4-FFN g{g} + INT4 LM head + FP32", "float32", g, {"int4_lm_head": True}) for g in INT4_GROUPS]
# int8_weights: INT8 for every linear left dense (on this CPU the INT8 kernels quantize activations per 32 columns,
# as the GPU's one-row dp4a kernel does)
VARIANTS += [("INT8 (all linears) + FP32", "float32", None, {"int8_weights": True}),
             ("INT4-FFN g32 + INT8 + FP32", "float32", 32, {"int8_weights": True})]


def held_out_windows(tokenizer, data: str | None, num_tokens: int, window: int) -> list[list[int]]:
    """Windows of held-out documentation tokens (docs/ pages of the held-out split)."""
    _, _, held = reference_corpus.split(reference_corpus.load(data, ("docs",)))
    eot = tokenizer.token_id("<|endoftext|>")
    ids: list[int] = []
    for text in held.values():
        ids += tokenizer.encode(text, add_special_tokens=False) + [eot]
        if len(ids) >= num_tokens:
            break
    ids = ids[:num_tokens]
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]


def make_engine(model_dir: str, dtype: str, group: int | None, window: int, **settings) -> LLMEngine | None:
    """An engine for one variant, or None when this build cannot make it (INT4 not yet there, say); settings:
    more O3Config fields (backend, int4_lm_head). The torch backend unless settings say otherwise."""
    if dtype.startswith("preset:"):  # an engine directory built with `o3edge build --preset`
        model_dir, dtype = dtype.removeprefix("preset:"), "auto"
    cfg = O3Config(**{**dict(model_path=model_dir, device="cpu", dtype=dtype, int4_ffn=group is not None,
                             int4_group_size=group or 128, num_kv_blocks=window // 32 + 2, cuda_graphs=False,
                             backend="torch"), **settings})
    try:
        engine = LLMEngine(cfg, model_dir)
    except Exception as exc:  # noqa: BLE001 - any failure means "not available", reported as such
        log.warning("%s/int4=%s unavailable: %s", dtype, group, exc)
        return None
    if group is not None and not any("int4" in type(m).__name__.lower() for m in engine.runner.model.modules()):
        log.warning("int4_ffn=True loaded no INT4 module: this build ignores it")
        return None
    return engine


class Tally:
    """Running NLL, KL from the reference, and top-1 agreement over scored positions."""

    def __init__(self):
        self.nll = self.kl = 0.0
        self.agree = self.count = 0

    def add(self, logits: torch.Tensor, ref: torch.Tensor, ids: list[int]) -> None:
        # logits, ref: [W, V] float32; position t predicts ids[t + 1]
        logp, ref_logp = F.log_softmax(logits[:-1], -1), F.log_softmax(ref[:-1], -1)
        target = torch.tensor(ids[1:])
        self.nll -= logp.gather(1, target[:, None]).sum().item()
        self.kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
        self.agree += (logp.argmax(-1) == ref_logp.argmax(-1)).sum().item()
        self.count += len(target)

    def row(self) -> dict:
        return {"ppl": math.exp(self.nll / self.count), "kl": self.kl / self.count,
                "top1": self.agree / self.count}


def hf_scorer(model_dir: str):
    """transformers' FP32 logits for a window, or None when transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def score(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float()

    return score


def evaluate(model_dir: str, wins: list[list[int]], window: int, with_hf: bool = True,
             variants: list | None = None) -> tuple[list, float | None]:
    """One row per variant (None where unavailable) and transformers' largest logit difference from FP32."""
    engines = [(label, make_engine(model_dir, dtype, g, window, **(settings[0] if settings else {})))
               for label, dtype, g, *settings in variants or VARIANTS]
    hf = hf_scorer(model_dir) if with_hf else None
    tallies = {label: Tally() for label, e in engines if e is not None}
    hf_tally, max_diff = Tally(), 0.0
    for i, ids in enumerate(wins):
        ref = engines[0][1].score(ids)
        for label, engine in engines:
            if engine is not None:  # the native backend's scores are NumPy arrays
                tallies[label].add(torch.as_tensor(engine.score(ids)).float(), ref, ids)
        if hf is not None:
            theirs = hf(ids)
            hf_tally.add(theirs, ref, ids)
            max_diff = max(max_diff, (theirs - ref).abs().max().item())
        log.info("window %d/%d", i + 1, len(wins))
    rows = [(label, tallies[label].row() if label in tallies else None) for label, _ in engines]
    if hf is not None:
        rows.insert(1, ("transformers FP32", hf_tally.row()))
    return rows, (max_diff if hf is not None else None)


def machine() -> str:
    return f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, Python {platform.python_version()}"


def table(rows: list, max_diff: float | None, meta: dict) -> str:
    """The markdown section for docs/benchmarks.md."""
    fp32 = dict(rows)["FP32"]["ppl"]
    lines = [SECTION, "",
             f"Model `{meta['model']}` ({meta['params'] / 1e6:.2f} M parameters). Held-out split: "
             f"{meta['tokens']:,} tokens of the held-out Python documentation pages (the first "
             f"{meta['tokens']:,} only, to keep CPU time modest), {meta['windows']} windows of {meta['window']} "
             "tokens, each window's first token unscored. KL and top-1 are against the FP32 engine, per position.",
             "", f"- date: {meta['date']}", f"- command: `{meta['command']}`", f"- machine: {meta['machine']}",
             f"- time: {meta['seconds']:.0f} s", "",
             "| engine | held-out ppl | vs FP32 | mean KL from FP32 (nats) | top-1 agrees with FP32 |",
             "|---|---:|---:|---:|---:|"]
    for label, r in rows:
        if r is None:
            lines.append(f"| {label} | not available in this build | | | |")
        else:
            lines.append(f"| {label} | {r['ppl']:.4f} | {100 * (r['ppl'] / fp32 - 1):+.2f}% | {r['kl']:.2e} "
                         f"| {100 * r['top1']:.2f}% |")
    lines += ["", "INT4-FFN rows: `O3Config(int4_ffn=True, int4_group_size=g)`, weight-only INT4 for the FFN "
                  "projections, quantized at load time; the rest of the model in the dtype named. Perplexity "
                  "depends on the window length: the model card's figures use 1,024-token windows."]
    if max_diff is not None:
        lines += ["", f"Largest |logit difference| between transformers and the FP32 engine over all windows: "
                      f"{max_diff:.2e}."]
    return "\n".join(lines) + "\n"


def write_section(path: str, section: str, heading: str = SECTION) -> None:
    """Replace the section under `heading` (this tool's by default; others stay), or append it."""
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else "# o3edge benchmarks\n"
    pattern = re.compile(re.escape(heading) + r".*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text.rstrip("\n") + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    ap.add_argument("--data", default=None, help="packed corpus; default: .corpus/ or the local python3.X-doc")
    ap.add_argument("--tokens", type=int, default=20000, help="held-out tokens to score")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--write", default=None, help="markdown file to put the table in (e.g. docs/benchmarks.md)")
    ap.add_argument("--preset", nargs="*", default=[], choices=("cpu-int8", "cpu-int4", "cpu-int4-all"),
                    help="also score engine directories built with `o3edge build --preset` (built in a temp dir)")
    ap.add_argument("--native", action="store_true",
                    help="also score each --preset directory on [engine] backend = \"native\" (no torch in its step)")
    ap.add_argument("--only", nargs="*", default=None, help="score only these variant labels (FP32 always)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    model_dir = resolve_model_path(a.model)
    probe = make_engine(model_dir, "float32", None, a.window)
    wins = held_out_windows(probe.tokenizer, a.data, a.tokens, a.window)
    params = sum(p.numel() for p in probe.runner.model.parameters())
    del probe
    variants = [v for v in VARIANTS if a.only is None or v[0] == "FP32" or v[0] in a.only]
    tmp = tempfile.TemporaryDirectory()
    for preset in a.preset:
        from o3edge.engine.engine_dir import build_engine_dir

        out = os.path.join(tmp.name, preset)
        build_engine_dir(model_dir, out, torch.float32, None, preset=preset)
        variants.append((f"preset {preset}", f"preset:{out}", None))
        if a.native:
            variants.append((f"preset {preset}, native backend", f"preset:{out}", None, {"backend": "native"}))
    rows, max_diff = evaluate(model_dir, wins, a.window, not a.no_transformers, variants)
    tmp.cleanup()
    meta = dict(model=os.path.relpath(model_dir, REPO) if model_dir.startswith(REPO) else model_dir,
                params=params, tokens=len(wins) * a.window, windows=len(wins), window=a.window,
                date=datetime.date.today().isoformat(), machine=machine(), seconds=time.time() - t0,
                command="python tools/eval_reference.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    section = table(rows, max_diff, meta)
    print(section)
    if a.write:
        write_section(a.write, section)
    return rows, max_diff


if __name__ == "__main__":
    main()
