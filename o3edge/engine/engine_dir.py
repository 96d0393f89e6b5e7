"""The engine directory: a manifest, weights already in our names and layout, and the tokenizer.

    manifest.json        what was built from what, and how (format below; FORMAT_VERSION)
    model.safetensors    our parameter names, fused (attn.qkv, mlp.gate_up), in the built dtype;
                         INT4 modules as <name>.qweight (uint8) + <name>.scales_and_zeros (bf16);
                         INT8 modules (CPU presets) as <name>.qweight8 (int8) + <name>.scales8 (float32)
    tokenizer.json ...   copied from the source checkpoint (config.json too, for other tools)

Loading one is mmap + assign: no renaming, no fusing, no quantization.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import shutil

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from o3edge.engine.checkpoint import ModelArgs, fingerprint, load_tensors, read_json, read_model_args
from o3edge.engine import cpu_quant, gptq
from o3edge.engine.quant import GROUP_SIZES, SCHEME
from o3edge.errors import CheckpointError

FORMAT = "o3edge-engine"
FORMAT_VERSION = 2  # 2: INT8 modules and CPU presets (written only by builds that use them)
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "config.json", "special_tokens_map.json")
REQUIRED = ("format", "format_version", "model_args", "dtype", "quantization", "weights", "tokenizer", "source",
            "builder")


def is_engine_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def built_dtype(path: str) -> torch.dtype | None:
    """The dtype an engine directory was built in; None for a checkpoint (read_manifest checks the rest)."""
    if not is_engine_dir(path):
        return None
    dtype = getattr(torch, str(read_json(os.path.join(path, MANIFEST)).get("dtype")), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def args_to_json(args: ModelArgs) -> dict:
    return dataclasses.asdict(args)


def args_from_json(values: dict, where: str) -> ModelArgs:
    """ModelArgs from the manifest, naming any field that is missing or unknown."""
    names = {f.name for f in dataclasses.fields(ModelArgs)}
    required = {f.name for f in dataclasses.fields(ModelArgs)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing, unknown = sorted(required - set(values)), sorted(set(values) - names)
    if missing or unknown:
        raise CheckpointError(f"{where}: model_args has missing field(s) {missing} / unknown field(s) {unknown}")
    values = dict(values, eos_token_ids=tuple(values.get("eos_token_ids") or ()))
    return ModelArgs(**values)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A checked manifest.json; `raw` keeps every field (the precision report among them)."""

    path: str
    args: ModelArgs
    dtype: torch.dtype
    group_size: int | None  # None: no INT4
    quantized: tuple[str, ...]  # INT4 module names, e.g. layers.0.mlp.gate_up
    raw: dict
    int8_modules: tuple[str, ...] = ()  # e.g. layers.0.attn.qkv, lm_head
    preset: str | None = None

    @property
    def weights_path(self) -> str:
        return os.path.join(self.path, self.raw["weights"]["file"])


def read_manifest(engine_dir: str) -> Manifest:
    """Read and check manifest.json, the weights file's size and the tokenizer's hash."""
    where = os.path.join(engine_dir, MANIFEST)
    raw = read_json(where)
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise CheckpointError(f"{where}: missing field(s) {', '.join(missing)}")
    if raw["format"] != FORMAT or not isinstance(raw["format_version"], int):
        raise CheckpointError(f"{where}: not an {FORMAT} manifest (format {raw['format']!r})")
    if raw["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{where}: engine format version {raw['format_version']} is newer than this "
                              f"o3edge reads ({FORMAT_VERSION}); upgrade o3edge or rebuild the engine")
    args = args_from_json(_field(raw, "model_args", dict, where), where)
    dtype = getattr(torch, str(raw["dtype"]), None)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise CheckpointError(f"{where}: dtype {raw['dtype']!r} is not float32, float16 or bfloat16")
    quant = raw["quantization"]
    group, modules, int8, preset = _quantization(quant, where)
    manifest = Manifest(engine_dir, args, dtype, group, modules, raw, int8, preset)
    _check_weights(manifest, where)
    _check_tokenizer(engine_dir, _field(raw, "tokenizer", dict, where), where)
    return manifest


def _field(raw: dict, key: str, kind: type, where: str):
    if not isinstance(raw.get(key), kind):
        raise CheckpointError(f"{where}: field {key!r} must be a {kind.__name__}")
    return raw[key]


def _quantization(quant, where: str) -> tuple[int | None, tuple[str, ...], tuple[str, ...], str | None]:
    """(INT4 group size, INT4 modules, INT8 modules, preset). Version 1 holds the INT4 part at the
    top level; version 2 has {"preset", "int4": {...} | null, "int8": {...} | null}."""
    if quant is None:
        return None, (), (), None
    if not isinstance(quant, dict):
        raise CheckpointError(f"{where}: quantization must be an object or null")
    if "scheme" not in quant:  # version 2
        group, modules, _, _ = _quantization(quant.get("int4"), where)
        int8 = quant.get("int8")
        if int8 is not None and (not isinstance(int8, dict) or int8.get("scheme") != cpu_quant.SCHEME
                                 or not isinstance(int8.get("modules"), list)):
            raise CheckpointError(f"{where}: quantization.int8 needs scheme {cpu_quant.SCHEME!r} and modules")
        return group, modules, tuple(int8["modules"]) if int8 else (), quant.get("preset")
    if any(k not in quant for k in ("scheme", "group_size", "modules")):
        raise CheckpointError(f"{where}: quantization needs scheme, group_size and modules")
    if quant["scheme"] != SCHEME or quant["group_size"] not in GROUP_SIZES:
        raise CheckpointError(f"{where}: quantization {quant['scheme']!r} with group size "
                              f"{quant['group_size']!r} is not supported ({SCHEME}, {GROUP_SIZES})")
    return quant["group_size"], tuple(quant["modules"]), (), None


def _check_weights(manifest: Manifest, where: str) -> None:
    weights = _field(manifest.raw, "weights", dict, where)
    if not isinstance(weights.get("file"), str) or not isinstance(weights.get("bytes"), int):
        raise CheckpointError(f"{where}: weights needs 'file' and 'bytes'")
    path = manifest.weights_path
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} not found")
    size = os.path.getsize(path)
    if size != weights["bytes"]:
        raise CheckpointError(f"{path} has {size} bytes, the manifest says {weights['bytes']}: "
                              f"the file is truncated or was replaced; rebuild the engine")


def _check_tokenizer(engine_dir: str, tok: dict, where: str) -> None:
    expected = tok.get("sha256")
    if not isinstance(expected, str):
        raise CheckpointError(f"{where}: tokenizer needs 'sha256' (of tokenizer.json)")
    path = os.path.join(engine_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} not found")
    if file_sha256(path) != expected:
        raise CheckpointError(f"{path} does not match the tokenizer the engine was built with "
                              f"(sha256 differs from the manifest's)")


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
