"""Reading a Hugging Face checkpoint directory: config, sharded safetensors, and a fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

from safetensors import safe_open

from o3edge.errors import CheckpointError

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelArgs:
    """The decoder's shape, read from config.json; the same for every Llama-family model."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm on each head of q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)


def _int_list(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _require(cfg: dict, key: str, path: str):
    if key not in cfg:
        raise CheckpointError(f"{path}: config.json lacks '{key}'")
    return cfg[key]


def read_model_args(model_dir: str) -> ModelArgs:
    """Parse config.json into ModelArgs, refusing architectures we cannot run."""
    path = os.path.join(model_dir, "config.json")
    cfg = read_json(path)
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED), None)
    if arch is None:
        raise CheckpointError(
            f"{path}: architecture {archs or cfg.get('model_type')!r} is not supported "
            f"(supported: {', '.join(sorted(SUPPORTED))})")
    family = SUPPORTED[arch]
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", family == "llama") and window < cfg.get("max_position_embeddings", 0):
        raise CheckpointError(f"{path}: sliding-window attention ({window}) is not supported")
    hidden = _require(cfg, "hidden_size", path)
    heads = _require(cfg, "num_attention_heads", path)
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise CheckpointError(f"{path}: {heads} attention heads is not a multiple of {kv_heads} KV heads")
    gen = read_json(os.path.join(model_dir, "generation_config.json"), missing_ok=True)
    eos = _int_list(gen.get("eos_token_id")) or _int_list(cfg.get("eos_token_id"))
    return ModelArgs(
        family=family,
        vocab_size=_require(cfg, "vocab_size", path),
        hidden_size=hidden,
        num_layers=_require(cfg, "num_hidden_layers", path),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=_require(cfg, "intermediate_size", path),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
        qk_norm=family == "qwen3",
        bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
        eos_token_ids=eos,
    )


def _rope_scaling(cfg: dict) -> dict | None:
    """The rope scaling table, from either the classic or the transformers-5 key."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind not in ("llama3", "linear"):
        raise CheckpointError(f"rope scaling type {kind!r} is not supported (llama3, linear)")
    return dict(scaling, rope_type=kind)


def read_json(path: str, missing_ok: bool = False) -> dict:
    """Load a JSON object, turning every failure into a CheckpointError naming the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise CheckpointError(f"{path} not found") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return value


def weight_files(model_dir: str) -> list[str]:
    """The safetensors files of a checkpoint, single or sharded (via its index)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        names = sorted(set(read_json(index).get("weight_map", {}).values()))
        files = [os.path.join(model_dir, n) for n in names]
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise CheckpointError(f"{model_dir}: shard(s) named in the index are missing: {missing}")
        return files
    files = sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found")
    return files


def load_tensors(model_dir: str) -> dict:
    """All tensors of the checkpoint by name (mmap-backed CPU tensors)."""
    tensors = {}
    for path in weight_files(model_dir):
        try:
            with safe_open(path, framework="pt") as fh:
                for name in fh.keys():
                    tensors[name] = fh.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types for truncation
            raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None
    return tensors


def fingerprint(model_dir: str) -> str:
    """A stable identity of the weights: hashes config.json and each weight file's header and size."""
    digest = hashlib.blake2b(digest_size=16)
    with open(os.path.join(model_dir, "config.json"), "rb") as fh:
        digest.update(fh.read())
    for path in weight_files(model_dir):
        size = os.path.getsize(path)
        digest.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as fh:
            digest.update(fh.read(1 << 16))
            if size > 1 << 17:
                fh.seek(size - (1 << 16))
                digest.update(fh.read())
    return digest.hexdigest()
