"""CPU decode steps: metadata built straight from the block tables, attention over the live prefix.

A decode step (one new token per sequence) on the CPU spends most of its time in small ops, not in
weights: the generic `ModelRunner.prepare` builds a padded key-slot table, a mask over whole blocks
and gathers every layer's keys and values through it (two `index_select` per layer). Here, when each
sequence's blocks are consecutive in the pool (the usual case: the allocator hands out free blocks in
order), its keys are one slice of the cache, `[start, start + length)`, that attention reads as a
view: no gather, no mask, exactly the live prefix. A sequence whose blocks are scattered (a prefix-cache
hit, a pool that wrapped around) has its live prefix's slots gathered into the same layout, so that
attention computes exactly what it would over a view, and the same prompt gives the same logits
wherever its blocks lie (the generic path's padded, masked attention rounds differently, and an INT4
model's activation rounding turns that into different greedy tokens). The compiled and INT8 decode
forwards read a slice only; for them scattered blocks, and for all of them prefill chunks, take the
generic path.
"""

from __future__ import annotations

import math
import mmap

import torch


def contiguous_start(table: list[int], num_blocks: int) -> int | None:
    """The first block id if the first num_blocks blocks of the table are consecutive, else None."""
    first = table[0]
    return first if table[num_blocks - 1] - first == num_blocks - 1 and all(
        b == first + i for i, b in enumerate(table[:num_blocks])) else None


class CpuDecode:
    """Builds the inputs of a CPU decode step; `prepare` returns None when the step does not fit."""

    def __init__(self, block_size: int, max_batch: int = 8, fast_forward: bool = False):
        self.block_size, self.max_batch = block_size, max_batch
        self.fast_forward = fast_forward  # run decode_forward instead of the model's own forward
        self.compiled = None  # cpu_compiled.CompiledDecode when [engine] cpu_compile is on
        self.native = None  # cpu_step.NativeDecode when [engine] cpu_native_step applies (taken first)

    def prepare(self, batch):
        """(input ids [B], positions [B], StepBatch with kv_spans) or None. With the native step (cpu_step.py),
        the StepBatch carries the block tables instead, and sequences whose blocks are scattered fit too."""
        if len(batch) > self.max_batch or any(n != 1 for _, n in batch):
            return None
        bs, native = self.block_size, self.native is not None
        ids, pos, slots, spans, tables = [], [], [], [], []
        for seq, _ in batch:
            p = seq.num_computed_tokens  # position of the new token; keys are [0, p]
            nb = p // bs + 1
            if native:
                tables.append(seq.block_table[:nb])
            else:
                start = contiguous_start(seq.block_table, nb)
                if start is not None:
                    spans.append((start * bs, start * bs + p + 1))
                elif self.fast_forward or self.compiled is not None:
                    return None  # their attention reads a slice of the cache
                else:  # the live prefix's slots, in order
                    from o3edge.engine.runner import key_slots  # runner.py imports this module

                    spans.append(key_slots(torch.tensor([seq.block_table[:nb]]), bs)[0, :p + 1])
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[nb - 1] * bs + p % bs)
        from o3edge.engine.model import StepBatch  # model.py imports span_attention from here

        B = len(batch)
        slot_mapping = torch.tensor(slots)
        arange = torch.arange(B)
        common = dict(slot_mapping=slot_mapping, q_dest=arange, attn_mask=None, num_seqs=B, max_q=1,
                      logits_index=arange, dense=True)
        if native:
            width = max(len(t) for t in tables)
            table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
            step = StepBatch(**common, kv_slots=None, tables=table, block_size=bs)
        else:
            step = StepBatch(**common, kv_slots=slot_mapping[:, None], kv_spans=tuple(spans))
        return torch.tensor(ids), torch.tensor(pos), step


def span_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spans) -> torch.Tensor:
    """q: [B, H, hd], one new token per sequence; keys of sequence b are cache slots spans[b] (start, end),
    or the slots in a LongTensor (scattered blocks: gathered into the same layout) -> [B, H, hd].

    A bfloat16 or float16 query and cache attend in float32, the result rounded back: torch's CPU attention of one
    query in those types is several times slower than in float32 with the conversions (tools/bench_cpu_attention.py;
    docs/benchmarks.md, "Token router on a bfloat16 CPU engine")."""
    dtype = q.dtype
    widen = q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
    outs = []
    for b, span in enumerate(spans):
        if isinstance(span, tuple):
            k, v = k_cache[span[0]:span[1]], v_cache[span[0]:span[1]]  # views
        else:
            k, v = k_cache.index_select(0, span), v_cache.index_select(0, span)
        k = k.transpose(0, 1)[None]  # [1, KVH, S, hd]
        v = v.transpose(0, 1)[None]
        qb = q[b, None, :, None]
        if widen:
            qb, k, v = qb.float(), k.float(), v.float()
        out = torch.nn.functional.scaled_dot_product_attention(qb, k, v, enable_gqa=True)
        outs.append(out.view(1, *q.shape[1:]).to(dtype))  # [1, H, hd]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in anonymous memory whose pages the OS maps on first write: a KV pool allocated this
    way adds to resident memory only as the cache fills (torch.zeros writes every page up front)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=dtype, count=math.prod(shape)).view(shape)


def rope_matrices(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """cos, sin: [B, hd] -> R [B, hd, hd] with x @ R == apply_rope(x) (rotate-half convention).

    Built once per step, it turns each layer's RoPE (slices, a concatenation, a negation, two products
    and a sum) into one small batched matmul."""
    B, hd = cos.shape
    half = hd // 2
    perm = torch.zeros(hd, hd, dtype=cos.dtype)
    idx = torch.arange(half)
    perm[idx + half, idx] = -1.0  # out[i] gets -x[i + half] * sin[i] for i < half
    perm[idx, idx + half] = 1.0  # and x[i - half] * sin[i] for i >= half
    return torch.diag_embed(cos) + perm * sin[:, None, :]


def native_attention(kv_cache: torch.Tensor) -> bool:
    """Whether the decode step's attention can run o3edge's C++ span attention: a contiguous pool it reads
    (cpu_ext.reads_cache)."""
    from o3edge.engine import cpu_ext

    return kv_cache.is_contiguous() and cpu_ext.reads_cache(kv_cache)


@torch.inference_mode()
def decode_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                   sin_table: torch.Tensor, step, kv_cache: torch.Tensor) -> torch.Tensor:
    """The model's forward for a CPU decode step (one new token per sequence, keys in spans), with fewer
    small ops than Transformer.forward: RoPE as a matmul, norms fused. Same modules, same weights.

    input_ids, positions: [B]; kv_cache: [L, 2, slots, KVH, hd] -> logits [B, V] float32."""
    args = model.args
    H, KVH, hd = args.num_heads, args.num_kv_heads, args.head_dim
    B = input_ids.shape[0]
    rope = rope_matrices(cos_table[positions], sin_table[positions])  # [B, hd, hd]
    native = native_attention(kv_cache)
    x = model.embed(input_ids)  # [B, D]
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.attn, layer.mlp
        qkv = attn.qkv(layer.input_norm(x)).view(B, H + 2 * KVH, hd)
        qk, v = qkv[:, :H + KVH], qkv[:, H + KVH:]
        if attn.q_norm is not None:
            qk = torch.cat((attn.q_norm(qk[:, :H]), attn.k_norm(qk[:, H:])), dim=1)
        qk = torch.bmm(qk, rope)  # [B, H + KVH, hd]
        if native:  # KV write and attention in one C++ call (cpu_ext.py)
            out = torch.ops.o3edge_cpu.span_attention(qk[:, :H].contiguous(), qk[:, H:].contiguous(), v.contiguous(),
                                                      kv_cache, i, step.slot_mapping, positions)
        else:
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            k_cache.index_copy_(0, step.slot_mapping, qk[:, H:])
            v_cache.index_copy_(0, step.slot_mapping, v)
            out = span_attention(qk[:, :H], k_cache, v_cache, step.kv_spans)  # [B, H, hd]
        x = x + attn.o(out.reshape(B, H * hd))
        gate, up = mlp.gate_up(layer.post_norm(x)).chunk(2, dim=-1)
        x = x + mlp.down(torch.nn.functional.silu(gate) * up)
    x = model.norm(x)
    if model.lm_head is None:
        return torch.nn.functional.linear(x, model.embed.weight).float()
    return model.lm_head(x).float()
