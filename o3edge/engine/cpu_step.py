"""The native CPU decode step (`[engine] cpu_native_step`, on by default): a quantized engine's whole decode
step as one C++ call (cpu_step.cpp), no torch operators between its kernels.

One OpenMP parallel region runs the 30-odd layers: each matmul splits its weight blocks over the threads
(o3edge's VNNI row kernels, the same as the per-layer operators), attention splits the keys (each thread
reads its share of the KV rows once, for every head, and the partial softmax states are merged), and
the threads meet at five barriers a layer; norms and activation quantization run in every thread for
itself, residual adds are fused into the matmuls. Against the compiled step (`cpu_compile`) it has no
Dynamo guards, no compiler import (~200 MB of RSS) and no compile at start-up.

It applies where every linear layer, the LM head included, runs o3edge's VNNI kernels (cpu_ext.py) and
the model is a bias-free llama-family decoder with a float32 contiguous KV pool; elsewhere `build` returns
None and the step stays the eager or compiled one. The weights are the modules' own tensors: no copy. Keys
are read through the block tables, so a sequence whose blocks are not consecutive (a prefix-cache hit)
stays on this step too (the eager and compiled steps need consecutive blocks).
"""

from __future__ import annotations

import time

import torch

from o3edge.engine.cpu_quant import Int8Linear
from o3edge.engine.quant import Int4Linear
from o3edge.engine.threads import ThreadProbe


def _linear(mod) -> tuple[list[torch.Tensor], list[int]] | None:
    """(tensors, [int4, N, K, Kp, G]) of a layer the native step can run, else None."""
    if isinstance(mod, Int8Linear) and mod.kernel == "vnni":
        return [mod.weight, mod.wsum, mod.scales], [0, mod.out_features, mod.in_features, mod.in_features, mod.group]
    if isinstance(mod, Int4Linear) and mod.vnni:
        sz = mod.scales_and_zeros
        return [mod.weight, sz[0], sz[1]], [1, mod.out_features, mod.in_features, mod.k_padded, mod.group_size]
    return None


def _norm(mod) -> torch.Tensor:
    return torch.empty(0) if mod is None else mod.weight.detach().float().contiguous()


def build(model, kv_cache: torch.Tensor):
    """A `torch.classes.o3edge_cpu.DecodeModel` over the model's weights, or None where it does not apply."""
    from o3edge.engine import cpu_ext

    args = model.args
    if (kv_cache.dtype != torch.float32 or not kv_cache.is_contiguous() or args.attention_bias
            or model.lm_head is None or model.embed.weight.dtype != torch.float32 or not cpu_ext.available()):
        return None
    tensors = [model.embed.weight.detach().contiguous(), _norm(model.norm)]
    ints = [args.num_heads, args.num_kv_heads, args.head_dim]
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        tensors += [_norm(layer.input_norm), _norm(layer.post_norm), _norm(attn.q_norm), _norm(attn.k_norm)]
        for mod in (attn.qkv, attn.o, mlp.gate_up, mlp.down):
            got = _linear(mod)
            if got is None:
                return None
            tensors += got[0]
            ints += got[1]
    got = _linear(model.lm_head)
    if got is None:
        return None
    tensors += got[0]
    ints += got[1]
    return torch.classes.o3edge_cpu.DecodeModel(tensors, ints, float(model.norm.eps))


class NativeDecode:
    """Call like cpu_decode.decode_forward: (input_ids, positions, cos, sin, step, kv_cache) -> logits [B, V].
    Threads: all of torch's by default, dropping to one while other processes hold the cores (threads.py)."""

    def __init__(self, native, threads: int | None = None):
        self.native = native
        self.probe = ThreadProbe(threads or torch.get_num_threads())

    def __call__(self, input_ids, positions, cos_table, sin_table, step, kv_cache) -> torch.Tensor:
        n = self.probe.pick()
        t = time.perf_counter()
        logits = self.native.step(input_ids, positions, step.slot_mapping, step.tables, step.block_size, cos_table,
                                  sin_table, kv_cache, n)
        self.probe.timed(n, time.perf_counter() - t)
        return logits
