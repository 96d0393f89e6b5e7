"""The engine directory: a manifest, weights already in our names and layout, and the tokenizer.

    manifest.json        what was built from what, and how (format below; FORMAT_VERSION)
    model.safetensors    our parameter names, fused (attn.qkv, mlp.gate_up), in the built dtype;
                         INT4 modules as <name>.qweight (uint8) + <name>.scales_and_zeros (bf16);
                         INT8 modules (CPU presets) as <name>.qweight8 (int8) + <name>.scales8 (float32)
    tokenizer.json ...   copied from the source checkpoint (config.json too, for other tools)

Loading one is mmap + assign: no renaming, no fusing, no quantization.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from o3edge.engine import cpu_quant, gptq
from o3edge.engine.checkpoint import ModelArgs, fingerprint, load_tensors, read_json, read_model_args
from o3edge.engine.manifest import (FORMAT, FORMAT_VERSION, MANIFEST, REQUIRED, TOKENIZER_FILES,  # noqa: F401
                                    WEIGHTS, Manifest, args_from_json, args_to_json, file_sha256, is_engine_dir,
                                    read_manifest)
from o3edge.engine.quant import SCHEME
from o3edge.errors import CheckpointError

def built_dtype(path: str) -> torch.dtype | None:
    """The dtype an engine directory was built in; None for a checkpoint (read_manifest checks the rest)."""
    if not is_engine_dir(path):
        return None
    dtype = getattr(torch, str(read_json(os.path.join(path, MANIFEST)).get("dtype")), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def load_weights(manifest: Manifest) -> dict[str, torch.Tensor]:
    """The engine's tensors by name, mmap-backed (nothing is read until used)."""
    path = manifest.weights_path
    try:
        with safe_open(path, framework="pt") as fh:
            return {name: fh.get_tensor(name) for name in fh.keys()}
    except Exception as exc:  # safetensors raises its own types for a broken header
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None


def copy_tokenizer(src_dir: str, out_dir: str) -> list[str]:
    """Copy the tokenizer and config files that exist; tokenizer.json is required."""
    if not os.path.isfile(os.path.join(src_dir, "tokenizer.json")):
        raise CheckpointError(f"{src_dir}: tokenizer.json not found (a fast tokenizer is required)")
    copied = []
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src_dir, name)):
            shutil.copyfile(os.path.join(src_dir, name), os.path.join(out_dir, name))
            copied.append(name)
    return copied


def write_manifest(engine_dir: str, raw: dict) -> None:
    """Write manifest.json atomically (a reader never sees half of one)."""
    tmp = os.path.join(engine_dir, MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(raw, fh, indent=1)
        fh.write("\n")
    os.replace(tmp, os.path.join(engine_dir, MANIFEST))


def build_engine_dir(src_dir: str, out_dir: str, dtype: torch.dtype, int4_group_size: int | None,
                     force: bool = False, progress=None, preset: str | None = None,
                     int4_all: bool = False, calibration_texts: list[str] | None = None,
                     calibration_tokens: int | None = None) -> Manifest:
    """Write an engine directory for a Hugging Face checkpoint; progress(name) after each tensor.
    With int4_group_size, the FFN projections are INT4 (int4_all: every linear layer).

    A preset (cpu_quant.PRESETS) sets the dtype, INT4 group, INT4 and INT8 modules and INT4 method itself;
    a calibrated method (GPTQ) runs the model over calibration_tokens (default gptq.CALIBRATION_TOKENS) tokens
    of calibration_texts (default: gptq.calibration_texts, the docstrings of this Python's standard library)
    tokenized by the checkpoint's tokenizer.

    The directory is written beside out_dir and renamed into place at the end, so a build that
    fails or is interrupted never leaves something that looks like an engine.
    """
    from o3edge.engine.loader import build_state_dict, preset_modules  # the loader reads engine dirs

    if os.path.exists(out_dir) and os.listdir(out_dir) and not force:
        raise CheckpointError(f"{out_dir} exists and is not empty; remove it or build with --force")
    args = read_model_args(src_dir)
    int8: list[str] = []
    int4, method = None, "rtn"
    if preset is not None:
        if preset not in cpu_quant.PRESETS:
            raise CheckpointError(f"unknown preset {preset!r}; choose from {sorted(cpu_quant.PRESETS)}")
        p = cpu_quant.PRESETS[preset]
        dtype, int4_group_size, method = getattr(torch, p.dtype), p.int4_group_size, p.int4_method
        int4, int8 = preset_modules(args, p)
    calibration, calibration_info = _calibration(src_dir, args, method, calibration_texts, calibration_tokens)
    source = {"path": os.path.abspath(src_dir), "fingerprint": fingerprint(src_dir),
              "architectures": read_json(os.path.join(src_dir, "config.json")).get("architectures")}
    partial = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        state = build_state_dict(args, load_tensors(src_dir), dtype, int4_group_size, progress, int8, int4_all,
                                 int4, method, calibration)
        weights = os.path.join(partial, WEIGHTS)
        save_file({k: v.contiguous() for k, v in state.items()}, weights, metadata={"format": "pt"})
        os.chmod(weights, 0o644)  # safetensors writes 0600; the daemon's own user must be able to read it
        copied = copy_tokenizer(src_dir, partial)
        raw = _manifest(args, dtype, state, int4_group_size, source, copied, partial, preset, method,
                        calibration_info)
        write_manifest(partial, raw)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return read_manifest(out_dir)


def _calibration(src_dir: str, args: ModelArgs, method: str, texts: list[str] | None, num_tokens: int | None):
    """(token windows, what the manifest says of them) for a calibrated INT4 method; (None, None) for the others."""
    if not method.startswith("gptq"):
        return None, None
    from o3edge.engine.tokenizer import Tokenizer

    window = min(gptq.CALIBRATION_WINDOW, args.max_position_embeddings)
    windows = gptq.calibration_windows(Tokenizer(src_dir), num_tokens or gptq.CALIBRATION_TOKENS, window, texts)
    if not windows:
        raise CheckpointError(f"calibration text too short: INT4 method {method} needs at least {window} tokens")
    return windows, {"text": "user-supplied" if texts else gptq.CALIBRATION_TEXT, "window": window,
                     "tokens": sum(map(len, windows))}


def _manifest(args: ModelArgs, dtype: torch.dtype, state: dict, group: int | None, source: dict,
              tokenizer_files: list[str], out_dir: str, preset: str | None = None, method: str = "rtn",
              calibration: dict | None = None) -> dict:
    from o3edge import __version__  # o3edge/__init__ imports the engine: import it late

    modules = sorted(k.removesuffix(".qweight") for k in state if k.endswith(".qweight"))
    quant = None if group is None else {
        "scheme": SCHEME, "bits": 4, "group_size": group, "modules": modules,
        "layout": "qweight uint8 [N, Kp/2] (column 2i high nibble), scales_and_zeros bf16 [Kp/group, N, 2]; "
                  "w = (q - 8) * scale + zero; Kp = K rounded up to the group size with zero columns",
        "method": method}  # how q, scale and zero were chosen (gptq.METHODS); the format does not depend on it
    if quant is not None and calibration is not None:
        quant["calibration"] = calibration
    int8 = sorted(k.removesuffix(".qweight8") for k in state if k.endswith(".qweight8"))
    version = 1
    if int8 or preset:  # written as version 2 only when needed: older readers keep reading the rest
        version = 2
        quant = {"preset": preset, "int4": quant, "int8": {
            "scheme": cpu_quant.SCHEME, "bits": 8, "modules": int8,
            "layout": "qweight8 int8 [N, K], scales8 float32 [N]; w = q * scale; kernel picked at load "
                      "(fbgemm dynamic int8 on x86, else _weight_int8pack_mm, else dense)"} if int8 else None}
    return {
        "format": FORMAT, "format_version": version,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "builder": {"o3edge": __version__, "torch": torch.__version__, "safetensors": safetensors.__version__,
                    "python": platform.python_version()},
        "source": source,
        "model_args": args_to_json(args),
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": quant,
        "weights": {"file": WEIGHTS, "bytes": os.path.getsize(os.path.join(out_dir, WEIGHTS)),
                    "num_tensors": len(state)},
        "tokenizer": {"files": tokenizer_files, "sha256": file_sha256(os.path.join(out_dir, "tokenizer.json"))},
        "precision_report": None,
    }
