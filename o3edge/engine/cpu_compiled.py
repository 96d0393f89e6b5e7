"""A compiled CPU decode step (opt-in, `[engine] cpu_compile = true`): the whole batch-1..8 forward of a
quantized engine as one torch.compile (Inductor, C++) graph instead of ~900 eager ops.

What the graph holds: embedding, fused RMSNorms, RoPE, SiLU and the residual adds, fused into a few C++
loops per layer, and, where o3edge's CPU kernels are available (cpu_ext.py), every linear layer
(`o3edge_cpu::int8_linear` / `int4_linear`) and each layer's KV write plus attention over the live prefix
(`o3edge_cpu::span_attention`): ordinary operators the compiler traces, so with `cpp_wrapper` a step runs
no Python between its kernels. Without them, fbgemm INT8 layers (a packed weight the compiler cannot trace)
are called by number through one custom op, INT4 layers are `_weight_int4pack_mm_for_cpu`, and attention
is a custom op (`o3edge::span_decode_attention`) running the eager span attention of cpu_decode.py. Span
ends travel as tensors (slot and position of each new token), so the graph never specializes on a context
length: one graph for batch 1 and one (dynamic in the batch) for 2..8, compiled at warm-up.

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

from o3edge.engine.cpu_decode import native_attention, span_attention
from o3edge.engine.cpu_quant import Int8Linear
from o3edge.engine.quant import Int4Linear
from o3edge.paths import user_cache_dir

log = logging.getLogger(__name__)


# defined through torch.library.Library, not torch.library.custom_op: the latter's Python wrapper costs
# ~50 us more per call, and a step makes ~150 calls
_LIB = torch.library.Library("o3edge", "DEF")
_LIB.define("span_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, int layer, Tensor slots, "
            "Tensor positions) -> Tensor")
_LIB.define("fbgemm_int8_linear(Tensor x, int layer) -> Tensor")


def span_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                          slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Write the new tokens' k, v [B, KVH, hd] at slots [B] of layer's cache, attend q [B, H, hd] to each
    sequence's keys: slots [slot - position, slot] (consecutive, cpu_decode.CpuDecode) -> [B, H, hd]."""
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
    spans = [(s - p, s + 1) for s, p in zip(slots.tolist(), positions.tolist())]
    return span_attention(q, k_cache, v_cache, spans)


@torch.library.register_fake("o3edge::span_decode_attention")
def _(q, k, v, kv_cache, layer, slots, positions):
    return torch.empty_like(q)


# (packed weight, reduce_range, N) of every fbgemm layer of a compiled engine, for the life of the process
# (the same objects the layers hold: no copy); the graph calls them by index
_FBGEMM_LAYERS: list[tuple] = []


def fbgemm_int8_linear(x: torch.Tensor, layer: int) -> torch.Tensor:
    """x [M, K] float32, contiguous -> [M, N] through fbgemm INT8 layer number `layer` (its packed weight is an object
    the compiler cannot trace, so the graph calls it by number)."""
    packed, reduce_range, _ = _FBGEMM_LAYERS[layer]
    return torch.ops.quantized.linear_dynamic(x, packed, reduce_range)


@torch.library.register_fake("o3edge::fbgemm_int8_linear")
def _(x, layer):
    return x.new_empty(x.shape[0], _FBGEMM_LAYERS[layer][2])


_LIB.impl("span_decode_attention", span_decode_attention, "CPU")
_LIB.impl("fbgemm_int8_linear", fbgemm_int8_linear, "CPU")


def _linear(mod, x: torch.Tensor) -> torch.Tensor:
    handle = getattr(mod, "fbgemm_handle", None)
    return mod(x) if handle is None else torch.ops.o3edge.fbgemm_int8_linear(x.contiguous(), handle)


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


def decode_step(model, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                cos_table: torch.Tensor, sin_table: torch.Tensor, kv_cache: torch.Tensor,
                native: bool = False) -> torch.Tensor:
    """One new token per sequence: input_ids, positions, slots [B] -> logits [B, V] float32; native: attention
    through o3edge's C++ operator (cpu_ext.py) instead of the Python one."""
    args = model.args
    H, KVH, hd = args.num_heads, args.num_kv_heads, args.head_dim
    B = input_ids.shape[0]
    cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]  # [B, 1, hd]
    x = model.embed(input_ids)
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.attn, layer.mlp
        qkv = _linear(attn.qkv, _rms(x, layer.input_norm)).view(B, H + 2 * KVH, hd)
        qk, v = qkv[:, :H + KVH], qkv[:, H + KVH:]
        if attn.q_norm is not None:
            qk = torch.cat((_rms(qk[:, :H], attn.q_norm), _rms(qk[:, H:], attn.k_norm)), dim=1)
        x1, x2 = qk[..., :hd // 2], qk[..., hd // 2:]
        qk = qk * cos + torch.cat((-x2, x1), dim=-1) * sin
        attend = torch.ops.o3edge_cpu.span_attention if native else torch.ops.o3edge.span_decode_attention
        out = attend(qk[:, :H].contiguous(), qk[:, H:].contiguous(), v.contiguous(), kv_cache, i, slots, positions)
        x = x + _linear(attn.o, out.reshape(B, H * hd))
        gate, up = _linear(mlp.gate_up, _rms(x, layer.post_norm)).chunk(2, dim=-1)
        x = x + _linear(mlp.down, F.silu(gate) * up)
    x = _rms(x, model.norm)
    logits = F.linear(x, model.embed.weight) if model.lm_head is None else _linear(model.lm_head, x)
    return logits.float()


def register_fbgemm(model) -> int:
    """Number the model's fbgemm INT8 layers for fbgemm_int8_linear; returns how many."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, Int8Linear) and mod.kernel == "fbgemm" and getattr(mod, "fbgemm_handle", None) is None:
            mod.fbgemm_handle = len(_FBGEMM_LAYERS)
            _FBGEMM_LAYERS.append((mod.packed, mod.reduce_range, mod.out_features))
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
    path = str(user_cache_dir() / "inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path  # read by Inductor when it first compiles
    return path


class CompiledDecode:
    """The compiled decode step of one model; call like decode_forward (the StepBatch's spans are implied
    by its slot_mapping and the positions)."""

    def __init__(self, model, max_batch: int):
        self.model, self.max_batch = model, max_batch
        self.cache_dir = inductor_cache_dir()
        Path(self.cache_dir).mkdir(parents=True, exist_ok=True)
        register_fbgemm(model)  # fbgemm beats int8pack at every decode shape here (tools/bench_cpu_kernels.py)
        # cpp_wrapper: the graph's launcher is C++ too, so a step runs no Python between its kernels
        self._step = torch.compile(decode_step, fullgraph=True, options={"cpp_wrapper": True})
        self.native = False  # attention through cpu_ext's C++ operator, settled by warm_up
        self.warmup_seconds: dict[int, float] = {}

    def __call__(self, input_ids, positions, cos_table, sin_table, step, kv_cache) -> torch.Tensor:
        return self._step(self.model, input_ids, positions, step.slot_mapping, cos_table, sin_table, kv_cache,
                          self.native)

    @torch.inference_mode()
    def warm_up(self, cos_table, sin_table, kv_cache, scratch_slot: int) -> None:
        """Compile (or load from the cache) the batch-1 graph and the dynamic 2..max_batch one, on the
        KV pool's scratch slot (position 0: each row attends to its own new key only)."""
        self.native = native_attention(kv_cache)
        for B in sorted({1, min(2, self.max_batch), min(3, self.max_batch)}):
            t = time.perf_counter()
            ids = torch.zeros(B, dtype=torch.long)
            slots = torch.full((B,), scratch_slot, dtype=torch.long)
            self._step(self.model, ids, torch.zeros(B, dtype=torch.long), slots, cos_table, sin_table, kv_cache,
                       self.native)
            self.warmup_seconds[B] = time.perf_counter() - t
        log.info("compiled CPU decode step ready in %.1f s (batch sizes %s; cache %s)",
                 sum(self.warmup_seconds.values()), sorted(self.warmup_seconds), self.cache_dir)
