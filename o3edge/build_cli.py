"""`o3edge build`: turn a Hugging Face checkpoint into an engine directory; `o3edge inspect`: show one.

  o3edge build SRC OUT [--int4-ffn/--no-int4-ffn] [--group-size 128] [--dtype bfloat16] [--check]
  o3edge build SRC OUT --preset cpu-int8|cpu-int4|cpu-int4-all [--calibration-text FILE ...]
                       [--calibration-tokens N] [--check]
  o3edge inspect ENGINE_DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from o3edge.config import INT4_GROUP_SIZES
from o3edge.errors import O3Error


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="o3edge", description="Build and inspect o3edge engine directories.")
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build an engine directory from a Hugging Face checkpoint")
    b.add_argument("src", help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    b.add_argument("out", help="engine directory to write")
    b.add_argument("--int4-ffn", action=argparse.BooleanOptionalAction, default=True,
                   help="weight-only INT4 for the FFN projections (default: on)")
    b.add_argument("--int4-all", action="store_true",
                   help="INT4 for every linear layer, the attention projections and an untied LM head too "
                        "(fewer bytes a token on the GPU; its precision cost is in the --check report)")
    b.add_argument("--group-size", type=int, choices=INT4_GROUP_SIZES, default=128,
                   help="INT4 group size along the input dimension (default: 128)")
    b.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="dtype of everything not INT4 (default: bfloat16; float32 runs faster on CPUs "
                        "without native bf16)")
    b.add_argument("--preset", choices=("cpu-int8", "cpu-int4", "cpu-int4-all"), default=None,
                   help="a CPU engine: cpu-int8 = every linear and the LM head INT8 (fastest on CPU); "
                        "cpu-int4 = FFN INT4 g32, the rest INT8; cpu-int4-all = every linear and the LM head "
                        "INT4 g32 by GPTQ, calibrated at build time (smallest). Sets dtype and INT4 itself")
    b.add_argument("--calibration-text", nargs="+", default=None, metavar="FILE",
                   help="text files a GPTQ preset calibrates on (default: the docstrings of Python's "
                        "standard library)")
    b.add_argument("--calibration-tokens", type=int, default=None, metavar="N",
                   help="tokens of calibration text a GPTQ preset runs the model over (default 65536; fewer "
                        "build faster)")
    b.add_argument("--check", action="store_true",
                   help="compute the precision-alignment report against the float32 source; store it in the manifest")
    b.add_argument("--check-tokens", type=int, default=32, help="greedy tokens per prompt for --check (default 32)")
    b.add_argument("--device", default="cpu", help="device the --check runs on (default: cpu)")
    b.add_argument("--force", action="store_true", help="replace OUT if it exists")
    i = sub.add_parser("inspect", help="show an engine directory's manifest and stored report")
    i.add_argument("engine_dir")
    e = sub.add_parser("export", help="export a checkpoint's decoder to ONNX (explicit KV inputs and outputs)")
    e.add_argument("src", help="checkpoint directory")
    e.add_argument("out", help="directory to write model.onnx, onnx.json and the tokenizer into")
    e.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    e.add_argument("--int4-group", type=int, choices=(0, *INT4_GROUP_SIZES), default=0,
                   help="FFN weights as INT4 MatMulNBits with this group size (0: keep them dense)")
    e.add_argument("--check", action="store_true",
                   help="compare ONNX Runtime's logits and greedy tokens with the torch engine's, store the table")
    e.add_argument("--check-tokens", type=int, default=32, help="greedy tokens per prompt for --check (default 32)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    console = Console(highlight=False, soft_wrap=True)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if a.command == "export":
            return export(a, console)
        return build(a, console) if a.command == "build" else inspect(a.engine_dir, console)
    except O3Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def build(a: argparse.Namespace, console: Console) -> int:
    import torch

    from o3edge.engine.checkpoint import read_model_args
    from o3edge.engine.engine_dir import build_engine_dir
    from o3edge.engine.model import hf_weight_map

    t0 = time.perf_counter()
    total = len(hf_weight_map(read_model_args(a.src)))
    group = a.group_size if a.int4_ffn else None
    what = f"{a.dtype}" + (f" + INT4 {'all linears' if a.int4_all else 'FFN'} (group {a.group_size})" if group else "")
    if a.preset:
        from o3edge.engine.cpu_quant import PRESETS

        what = f"preset {a.preset}: {PRESETS[a.preset].summary}"
        if PRESETS[a.preset].int4_method.startswith("gptq"):
            from o3edge.engine.gptq import CALIBRATION_TOKENS

            what += (f"; calibrating on {a.calibration_tokens or CALIBRATION_TOKENS:,} tokens first "
                     "(minutes for a model of 100M+ parameters)")
    console.print(f"building {a.out} from {a.src}: {what}", markup=False)
    with _progress(console, total) as step:
        manifest = build_engine_dir(a.src, a.out, getattr(torch, a.dtype), group, a.force, step, a.preset,
                                    a.int4_all, _read_texts(a.calibration_text), a.calibration_tokens)
    size = manifest.raw["weights"]["bytes"]
    console.print(f"wrote {a.out}: {size / 2**20:.1f} MiB of weights, {len(manifest.quantized)} INT4 modules, "
                  f"{len(manifest.int8_modules)} INT8 modules, {time.perf_counter() - t0:.1f} s", markup=False)
    if a.check:
        check(a, manifest, console)
    return 0


def _read_texts(paths: list[str] | None) -> list[str] | None:
    if not paths:
        return None
    texts = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as fh:
                texts.append(fh.read())
        except (OSError, UnicodeDecodeError) as exc:
            raise O3Error(f"cannot read calibration text {path}: {exc}") from None
    return texts


class _progress:
    """A rich progress bar on a terminal; otherwise one line per finished layer (logs, pipes)."""

    def __init__(self, console: Console, total: int):
        self.console, self.total, self.done, self.layer = console, total, 0, None
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console) if console.is_terminal else None
        self.t0 = time.perf_counter()

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task("converting", total=self.total)
        return self

    def __call__(self, name: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=name)
            return
        layer = name.split(".")[1] if name.startswith("layers.") else None
        if self.layer is not None and layer != self.layer:
            self._line(f"layer {self.layer}", self.done - 1)
        self.layer = layer

    def _line(self, what: str, done: int) -> None:
        self.console.print(f"  {what} done  [{done}/{self.total} tensors, "
                           f"{time.perf_counter() - self.t0:.1f} s]", markup=False)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        elif exc[0] is None:
            self._line(f"layer {self.layer}" if self.layer is not None else "embeddings and norms", self.done)
        return False


def check(a: argparse.Namespace, manifest, console: Console) -> None:
    from o3edge.engine.engine_dir import write_manifest
    from o3edge.engine.precision import compare_with_checkpoint

    console.print(f"checking against the float32 source on {a.device} "
                  f"({a.check_tokens} greedy tokens per prompt) ...", markup=False)
    report = compare_with_checkpoint(a.out, a.src, a.device, a.check_tokens)
    raw = dict(manifest.raw, precision_report=dict(report.to_dict(), device=a.device))
    write_manifest(a.out, raw)
    print_report(report, console)


def print_report(report, console: Console) -> None:
    if not console.is_terminal:
        console.print(report.format(), markup=False)
        return
    table = Table(title="precision alignment")
    for col in ("metric", report.reference, report.engine):
        table.add_column(col)
    for row in report.rows():
        table.add_row(*row)
    console.print(table)


def export(a: argparse.Namespace, console: Console) -> int:
    """o3edge export: the ONNX model, and with --check its precision-alignment table."""
    from o3edge.export.onnx_export import check_onnx, export_onnx

    manifest = export_onnx(a.src, a.out, a.dtype, a.int4_group)
    int4 = f", {manifest['int4_modules']} FFN projections INT4 g{a.int4_group}" if a.int4_group else ""
    console.print(f"wrote {os.path.join(a.out, 'model.onnx')} (opset {manifest['opset']}, {a.dtype}{int4}) "
                  f"in {manifest['export_seconds']:.1f} s", markup=False)
    if a.check:
        console.print(f"checking ONNX Runtime against the torch engine ({a.check_tokens} greedy tokens per "
                      "prompt) ...", markup=False)
        print_report(check_onnx(a.src, a.out, a.check_tokens), console)
    return 0


def inspect(engine_dir: str, console: Console) -> int:
    from o3edge.engine.engine_dir import read_manifest
    from o3edge.engine.precision import PrecisionReport
    from o3edge.export.onnx_export import MANIFEST

    onnx_manifest = os.path.join(engine_dir, MANIFEST)
    if os.path.exists(onnx_manifest):  # an ONNX export directory
        with open(onnx_manifest) as fh:
            raw = json.load(fh)
        console.print(f"onnx        {os.path.abspath(engine_dir)} (opset {raw['opset']}, {raw['dtype']}, "
                      f"{raw['num_layers']} layers)\nsource      {raw['source']}", markup=False)
        if raw.get("precision_report"):
            fields = {k: v for k, v in raw["precision_report"].items() if k in PrecisionReport.__dataclass_fields__}
            print_report(PrecisionReport(**fields), console)
        return 0
    m = read_manifest(engine_dir)
    raw, args = m.raw, m.args
    int4 = raw["quantization"] or {}
    int4 = int4 if "scheme" in int4 else int4.get("int4") or {}  # format version 1 / 2
    method = f", {int4['method']}" if int4.get("method", "rtn") != "rtn" else ""
    parts = ([f"INT4 group {m.group_size}, {len(m.quantized)} modules{method}"] if m.group_size else []) + (
        [f"INT8 {len(m.int8_modules)} modules"] if m.int8_modules else [])
    quant = "; ".join(parts) + (f" (preset {m.preset})" if m.preset else "") if parts else "none"
    lines = [f"engine      {os.path.abspath(engine_dir)} (format {raw['format_version']})",
             f"model       {args.family}: {args.num_layers} layers, hidden {args.hidden_size}, "
             f"{args.num_heads}/{args.num_kv_heads} heads, FFN {args.intermediate_size}, vocab {args.vocab_size}",
             f"dtype       {raw['dtype']}",
             f"quantized   {quant}",
             f"weights     {raw['weights']['bytes'] / 2**20:.1f} MiB",
             f"source      {raw['source']['path']} ({raw['source']['fingerprint']})",
             f"built       {raw.get('created', '?')} by o3edge {raw['builder'].get('o3edge')}, "
             f"torch {raw['builder'].get('torch')}"]
    console.print("\n".join(lines), markup=False)
    stored = raw.get("precision_report")
    if stored:
        fields = {k: v for k, v in stored.items() if k in PrecisionReport.__dataclass_fields__}
        print_report(PrecisionReport(**fields), console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
