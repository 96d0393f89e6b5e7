"""A compiled CPU decode step (opt-in, `[engine] cpu_compile = true`): the whole batch-1..8 forward of a
quantized engine as one torch.compile (Inductor, C++) graph instead of ~900 eager ops.

What the graph holds: embedding, fused RMSNorms, the INT8 / INT4 linears (torch's `_weight_int8pack_mm`
and `_weight_int4pack_mm_for_cpu`, bf16 activations: the fbgemm kernel's packed weight is an opaque
object the compiler cannot trace, so INT8 layers are re-laid out for int8pack), RoPE, SiLU and the
residual adds, fused into a few C++ loops per layer. What it leaves out: the KV write and attention,
one custom op per layer (`o3edge::span_decode_attention`) that runs the eager span attention of
cpu_decode.py on views of the live prefix. Span ends travel as tensors (slot and position of each new
token), so the graph never specializes on a context length: one graph for batch 1 and one (dynamic in
the batch) for 2..8, compiled at warm-up.

Inductor's artifacts go to a cache directory (TORCHINDUCTOR_CACHE_DIR when set, else
<user cache>/o3edge/inductor), so a restarted daemon reloads compiled code instead of running gcc.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from o3edge.engine.cpu_decode import span_attention
from o3edge.engine.cpu_quant import Int8Linear
from o3edge.engine.quant import Int4Linear

log = logging.getLogger(__name__)


@torch.library.custom_op("o3edge::span_decode_attention", mutates_args=("kv_cache",))
def span_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                          slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Write the new tokens' k, v [B, KVH, hd] at slots [B] of layer's cache, attend q [B, H, hd] to each
    sequence's keys: slots [slot - position, slot] (consecutive, cpu_decode.CpuDecode) -> [B, H, hd]."""
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
    spans = [(s - p, s + 1) for s, p in zip(slots.tolist(), positions.tolist())]
    return span_attention(q, k_cache, v_cache, spans)


@span_decode_attention.register_fake
def _(q, k, v, kv_cache, layer, slots, positions):
    return torch.empty_like(q)


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


def decode_step(model, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                cos_table: torch.Tensor, sin_table: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """One new token per sequence: input_ids, positions, slots [B] -> logits [B, V] float32."""
    args = model.args
    H, KVH, hd = args.num_heads, args.num_kv_heads, args.head_dim
    B = input_ids.shape[0]
    cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]  # [B, 1, hd]
    x = model.embed(input_ids)
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.attn, layer.mlp
        qkv = attn.qkv(_rms(x, layer.input_norm)).view(B, H + 2 * KVH, hd)
        qk, v = qkv[:, :H + KVH], qkv[:, H + KVH:]
        if attn.q_norm is not None:
            qk = torch.cat((_rms(qk[:, :H], attn.q_norm), _rms(qk[:, H:], attn.k_norm)), dim=1)
        x1, x2 = qk[..., :hd // 2], qk[..., hd // 2:]
        qk = qk * cos + torch.cat((-x2, x1), dim=-1) * sin
        out = torch.ops.o3edge.span_decode_attention(qk[:, :H].contiguous(), qk[:, H:].contiguous(),
                                                     v.contiguous(), kv_cache, i, slots, positions)
        x = x + attn.o(out.reshape(B, H * hd))
        gate, up = mlp.gate_up(_rms(x, layer.post_norm)).chunk(2, dim=-1)
        x = x + mlp.down(F.silu(gate) * up)
    x = _rms(x, model.norm)
    logits = F.linear(x, model.embed.weight) if model.lm_head is None else model.lm_head(x)
    return logits.float()


def to_int8pack(model) -> int:
    """Re-lay every fbgemm INT8 layer out for `_weight_int8pack_mm` (same int8 values and scales); the
    packed fbgemm weight is dropped. Returns how many layers changed."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, Int8Linear) and mod.kernel == "fbgemm":
            qt, _ = torch.ops.quantized.linear_unpack(mod.packed)
            mod.weight, mod.scales = qt.int_repr().contiguous(), qt.q_per_channel_scales().to(torch.bfloat16)
            mod.kernel, mod.packed = "int8pack", None
            n += 1
    return n


def compilable(model) -> bool:
    """Whether the compiled step applies: a quantized engine (float32 keeps its exact eager forward)."""
    return any(isinstance(m, (Int8Linear, Int4Linear)) for m in model.modules())


def inductor_cache_dir() -> str:
    """Where Inductor keeps compiled code: TORCHINDUCTOR_CACHE_DIR, else <user cache>/o3edge/inductor."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "o3edge", "inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path  # read by Inductor when it first compiles
    return path


class CompiledDecode:
    """The compiled decode step of one model; call like decode_forward (the StepBatch's spans are implied
    by its slot_mapping and the positions)."""

    def __init__(self, model, max_batch: int):
        self.model, self.max_batch = model, max_batch
        self.cache_dir = inductor_cache_dir()
        Path(self.cache_dir).mkdir(parents=True, exist_ok=True)
        to_int8pack(model)
        self._step = torch.compile(decode_step, fullgraph=True)
        self.warmup_seconds: dict[int, float] = {}

    def __call__(self, input_ids, positions, cos_table, sin_table, step, kv_cache) -> torch.Tensor:
        return self._step(self.model, input_ids, positions, step.slot_mapping, cos_table, sin_table, kv_cache)

    @torch.inference_mode()
    def warm_up(self, cos_table, sin_table, kv_cache, scratch_slot: int) -> None:
        """Compile (or load from the cache) the batch-1 graph and the dynamic 2..max_batch one, on the
        KV pool's scratch slot (position 0: each row attends to its own new key only)."""
        for B in sorted({1, min(2, self.max_batch), min(3, self.max_batch)}):
            t = time.perf_counter()
            ids = torch.zeros(B, dtype=torch.long)
            slots = torch.full((B,), scratch_slot, dtype=torch.long)
            self._step(self.model, ids, torch.zeros(B, dtype=torch.long), slots, cos_table, sin_table, kv_cache)
            self.warmup_seconds[B] = time.perf_counter() - t
        log.info("compiled CPU decode step ready in %.1f s (batch sizes %s; cache %s)",
                 sum(self.warmup_seconds.values()), sorted(self.warmup_seconds), self.cache_dir)
