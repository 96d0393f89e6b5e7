"""What the threads other than the engine's may know of the engine: one immutable view, made at load.

The engine thread is the engine's only owner. Once the engine is loaded and warmed up, the engine
loop builds an EngineView on its own thread and publishes it; the I/O thread (`info`, admission, the
prompt-size check), the tokenizer lanes and the daemon read only that. The one live object it holds
is the tokenizer's encode function: the tokenizer is never changed after load and its Rust core
encodes from several threads at once (the engine thread only decodes with it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from o3edge.engine.cpu_features import row_kernel_isa

if TYPE_CHECKING:
    from o3edge.engine.engine import LLMEngine


@dataclass(frozen=True)
class EngineView:
    """Fixed facts of a loaded engine, and its tokenizer's encode (thread-safe)."""

    encode: Callable[..., list[int]]  # (prompt, messages) -> token ids; raises InvalidRequest
    max_model_len: int
    max_prompt_bytes: int | None  # prompt bytes past which no prompt fits the context window (None: unknown)
    max_num_seqs: int  # the running batch's size: room the server's in-flight bound leaves above the queue
    model: dict  # the `info` reply's model fields
    memory_mib: dict  # the KV cache's and the weights' share of the daemon's memory, in MiB

    def describe(self, endpoint: str) -> str:
        """The daemon's `ready` log line."""
        m = self.model
        return (f"{m['model']} on {m['device']}/{m['dtype']}, {m['num_kv_blocks']} KV blocks, loaded in "
                f"{m['load_seconds']:.2f} s, on {endpoint}")


def view_of(engine: "LLMEngine") -> EngineView:
    """Engine thread: the view of a loaded engine."""
    info, tokenizer = engine.info, engine.tokenizer
    per_token = getattr(tokenizer, "max_token_bytes", None)
    config = getattr(engine, "config", None)
    return EngineView(encode=tokenizer.encode_request, max_model_len=info.max_model_len,
                      max_prompt_bytes=info.max_model_len * per_token() if per_token else None,
                      max_num_seqs=getattr(config, "max_num_seqs", 0), model=_model_info(engine),
                      memory_mib=_memory(engine))


def _model_info(engine: "LLMEngine") -> dict:
    i = engine.info
    offloader = getattr(engine, "offloader", None)
    return {"model": os.path.basename(os.path.normpath(i.model_dir)), "model_path": i.model_dir,
            "architecture": i.args.family, "dtype": i.dtype, "device": i.device, "backend": i.backend,
            "cpu_kernels": row_kernel_isa() if str(i.device) == "cpu" else None, "max_context": i.max_model_len,
            "vocab_size": i.args.vocab_size, "kv_block_size": i.kv_block_size, "num_kv_blocks": i.num_kv_blocks,
            "kv_cache_bytes": i.kv_cache_bytes, "fingerprint": i.fingerprint,
            "has_chat_template": bool(engine.tokenizer.chat_template), "load_seconds": round(i.load_seconds, 3),
            "cache_identity": i.cache_identity, "cold_tier": offloader.tier.path if offloader is not None else None}


def _memory(engine: "LLMEngine") -> dict:
    mib = lambda n: round(n / 2**20, 1)  # noqa: E731
    out = {"kv_cache_mib": mib(engine.info.kv_cache_bytes)}
    runner = getattr(engine, "runner", None)
    model = getattr(runner, "model", None)
    if model is not None:
        out["weights_mib"] = mib(sum(t.numel() * t.element_size() for t in model.state_dict().values()))
    elif hasattr(runner, "weights_bytes"):  # the native backend's NumPy arrays
        out["weights_mib"] = mib(runner.weights_bytes())
    return out
