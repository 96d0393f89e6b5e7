"""An engine directory's manifest: reading and checking it, without torch.

The native CPU backend (native_runner.py) serves an engine directory from a process that never imports
torch, so what it needs of the directory (the manifest, its checks, the model arguments) lives here;
engine_dir.py builds directories and loads their tensors for the torch backend.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

from o3edge.config import INT4_GROUP_SIZES as GROUP_SIZES
from o3edge.engine.checkpoint import ModelArgs, read_json
from o3edge.errors import CheckpointError

INT4_SCHEME = "int4-asym-groupwise"  # quant.py's INT4 format (w = (q - 8) * scale + zero per group)
INT8_SCHEME = "int8-sym-per-row"  # cpu_quant.py's INT8 format (w = q * scale per row)
DTYPES = ("float32", "float16", "bfloat16")
CPU_PRESETS = ("cpu-int8", "cpu-int4", "cpu-int4-all")  # cpu_quant.PRESETS' names: engines built for the CPU
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
    dtype_name: str  # float32, float16 or bfloat16 (the torch dtype: .dtype)
    group_size: int | None  # None: no INT4
    quantized: tuple[str, ...]  # INT4 module names, e.g. layers.0.mlp.gate_up
    raw: dict
    int8_modules: tuple[str, ...] = ()  # e.g. layers.0.attn.qkv, lm_head
    preset: str | None = None

    @property
    def dtype(self):
        """The torch dtype of the dense weights (imports torch: the native backend reads dtype_name)."""
        import torch

        return getattr(torch, self.dtype_name)

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
    dtype = str(raw["dtype"])
    if dtype not in DTYPES:
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
        if int8 is not None and (not isinstance(int8, dict) or int8.get("scheme") != INT8_SCHEME
                                 or not isinstance(int8.get("modules"), list)):
            raise CheckpointError(f"{where}: quantization.int8 needs scheme {INT8_SCHEME!r} and modules")
        return group, modules, tuple(int8["modules"]) if int8 else (), quant.get("preset")
    if any(k not in quant for k in ("scheme", "group_size", "modules")):
        raise CheckpointError(f"{where}: quantization needs scheme, group_size and modules")
    if quant["scheme"] != INT4_SCHEME or quant["group_size"] not in GROUP_SIZES:
        raise CheckpointError(f"{where}: quantization {quant['scheme']!r} with group size "
                              f"{quant['group_size']!r} is not supported ({INT4_SCHEME}, {GROUP_SIZES})")
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


def cpu_preset(path: str) -> str | None:
    """The CPU preset an engine directory was built with (`o3edge build --preset`), None for anything else (a
    checkpoint, a GPU build, an unreadable manifest: read_manifest reports those when the engine loads)."""
    try:
        quant = read_json(os.path.join(path, MANIFEST)).get("quantization")
    except Exception:  # noqa: BLE001 - not an engine directory, or a broken one: not a CPU preset either way
        return None
    preset = quant.get("preset") if isinstance(quant, dict) else None
    return preset if preset in CPU_PRESETS else None
