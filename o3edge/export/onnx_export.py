"""`o3edge export`: write an ONNX model of a checkpoint's decoder (explicit KV inputs and outputs).

The directory written holds `model.onnx` (weights in `model.onnx.data` beside it), the tokenizer files,
and `onnx.json`: what was exported (source, dtype, opset, I/O names, shapes of the KV tensors).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import torch

from o3edge.export.onnx_decoder import OnnxDecoder, io_names

log = logging.getLogger(__name__)

OPSET = 17
MANIFEST = "onnx.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "config.json")


def load_torch_engine(model_dir: str, dtype: str = "float32", max_model_len: int = 2048, int4_group: int = 0):
    """The torch engine on the CPU (the export's source and the alignment check's reference)."""
    from o3edge import O3Config, O3Model

    return O3Model.from_config(O3Config(model_path=model_dir, device="cpu", dtype=dtype, kv_cache_memory_mb=64,
                                        max_model_len=max_model_len, cuda_graphs=False, int4_ffn=bool(int4_group),
                                        int4_group_size=int4_group or 128)).engine


def export_onnx(model_dir: str, out_dir: str, dtype: str = "float32", int4_group: int = 0) -> dict:
    """Export model_dir's decoder to out_dir/model.onnx (FFN weights as INT4 MatMulNBits with
    int4_group); returns the manifest written."""
    t0 = time.perf_counter()
    engine = load_torch_engine(model_dir, dtype)
    runner, args = engine.runner, engine.info.args
    int4_modules = 0
    if int4_group:
        from o3edge.export.onnx_int4 import swap_ffn_to_nbits

        int4_modules = swap_ffn_to_nbits(runner.model, int4_group)
    decoder = OnnxDecoder(runner.model, runner.cos, runner.sin).eval()
    inputs, outputs = io_names(args.num_layers)
    tdtype = runner.dtype
    B, T, P = 1, 3, 2  # a step with some past: every axis below is dynamic
    past = [torch.zeros(B, args.num_kv_heads, P, args.head_dim, dtype=tdtype) for _ in range(2 * args.num_layers)]
    example = (torch.ones(B, T, dtype=torch.long), torch.arange(P, P + T)[None], torch.ones(B, P + T, dtype=torch.long),
               *past)
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "position_ids": {0: "batch", 1: "sequence"},
            "attention_mask": {0: "batch", 1: "total_sequence"}, "logits": {0: "batch", 1: "sequence"}}
    axes.update({n: {0: "batch", 2: "past_sequence"} for n in inputs[3:]})
    axes.update({n: {0: "batch", 2: "total_sequence"} for n in outputs[1:]})
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "model.onnx")
    with torch.inference_mode():
        torch.onnx.export(decoder, example, path, input_names=inputs, output_names=outputs, dynamic_axes=axes,
                          opset_version=OPSET, dynamo=False, external_data=True)
    for name in TOKENIZER_FILES:
        src = os.path.join(model_dir, name)
        if os.path.exists(src):
            shutil.copy(src, out_dir)
    manifest = {"format": "onnx", "source": os.path.abspath(model_dir), "dtype": dtype, "opset": OPSET,
                "int4_group_size": int4_group, "int4_modules": int4_modules,
                "inputs": inputs, "outputs": outputs, "num_layers": args.num_layers,
                "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim, "vocab_size": args.vocab_size,
                "kv_layout": "[batch, kv_heads, sequence, head_dim], keys after RoPE",
                "export_seconds": round(time.perf_counter() - t0, 2)}
    with open(os.path.join(out_dir, MANIFEST), "w") as fh:
        json.dump(manifest, fh, indent=1)
    log.info("exported %s to %s in %.1f s", model_dir, path, manifest["export_seconds"])
    return manifest


def check_onnx(model_dir: str, onnx_dir: str, num_new_tokens: int = 32, providers: list[str] | None = None):
    """The precision-alignment report of the ONNX export against the torch engine in the same dtype
    (and the same INT4 weights); stored in onnx.json."""
    from o3edge.engine.precision import alignment_report
    from o3edge.export.ort_engine import OrtDecoder

    path = os.path.join(onnx_dir, MANIFEST)
    with open(path) as fh:
        manifest = json.load(fh)
    decoder = OrtDecoder(onnx_dir, providers)
    reference = load_torch_engine(model_dir, manifest["dtype"], int4_group=manifest.get("int4_group_size", 0))
    report = alignment_report(reference, decoder, num_new_tokens=num_new_tokens)
    manifest["precision_report"] = dict(report.to_dict(), provider=decoder.provider)
    with open(path, "w") as fh:
        json.dump(manifest, fh, indent=1)
    return report
