"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from o3edge.engine.checkpoint import ModelArgs
from o3edge.engine.cpu_decode import span_attention
from o3edge.engine.rope import apply_rope


@dataclass
class StepBatch:
    """Attention metadata for one engine step, built by the runner and shared by every layer.

    The step's new tokens are packed flat ([T]); attention runs on a padded view of B sequences,
    each with up to Q new tokens attending to up to S cached-plus-new keys.
    """

    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    q_dest: torch.Tensor  # [T] index of each new token in the padded [B*Q] view
    kv_slots: torch.Tensor  # [B, S] cache slot of every key position (padding: any valid slot)
    attn_mask: torch.Tensor | None  # [B, 1, Q, S] True where a query may attend a key
    num_seqs: int  # B
    max_q: int  # Q
    logits_index: torch.Tensor  # [B] flat index of each sequence's last new token
    dense: bool = False  # every sequence has exactly Q new tokens: the padded view is the flat one
    kv_spans: tuple | None = None  # CPU decode: sequence b's keys are slots [start, end), or these slots (a LongTensor)
    # paged prefill kernel (CUDA): int32 [B, 3] (first flat row, new tokens, start position), int32 block
    # tables [B, blocks] and the block size; kv_slots and attn_mask are then unused (None)
    seqs: torch.Tensor | None = None
    tables: torch.Tensor | None = None
    block_size: int = 0
    router: object | None = None  # token router on: attention over both KV pools (router.RouterStep)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = False  # set for CPU INT8 engines (loader.py): one op instead of seven, no transformers rounding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda or self.fused:  # one fused kernel instead of seven: decode is launch-bound on the GPU
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # in float32, cast back before the weight: the same rounding as transformers
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.qkv = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias)
        self.o = nn.Linear(self.q_size, args.hidden_size, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.layer_id = 0  # set by Transformer: which layer of the router's compressed pool is this one's

    def forward(self, x, cos, sin, batch: StepBatch, k_cache, v_cache):
        # x: [T, D]; cos, sin: [T, hd]; k_cache, v_cache: [num_slots, KVH, hd]
        T = x.shape[0]
        qkv = self.qkv(x).view(T, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        H, KVH = self.num_heads, self.num_kv_heads
        qk, v = qkv[:, :H + KVH], qkv[:, H + KVH:]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])), dim=1)
        qk = apply_rope(qk, cos, sin)  # q and k rotated together: half the kernels
        q, k = qk[:, :H], qk[:, H:]
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)
        if batch.router is None:
            out = paged_attention(q, k_cache, v_cache, batch)  # [T, H, hd]
        else:
            out = batch.router.attend(self.layer_id, q, k_cache, v_cache)
        return self.o(out.reshape(T, self.q_size))


def paged_attention(q, k_cache, v_cache, batch: StepBatch) -> torch.Tensor:
    """q: [T, H, hd] -> [T, H, hd], attending to each sequence's keys through its slot table."""
    if batch.kv_spans is not None:  # keys are a slice of the cache: attend over a view (cpu_decode.py)
        return span_attention(q, k_cache, v_cache, batch.kv_spans)
    if batch.seqs is not None:  # keys read in place through the block tables (kernels/prefill_attention.py)
        from o3edge.engine.kernels.prefill_attention import prefill_attention

        return prefill_attention(q, k_cache, v_cache, batch.seqs, batch.tables, batch.max_q, batch.block_size)
    B, Q = batch.num_seqs, batch.max_q
    T, H, hd = q.shape
    padded = q if batch.dense else q.new_zeros(B * Q, H, hd).index_copy_(0, batch.q_dest, q)
    qp = padded.view(B, Q, H, hd).transpose(1, 2)  # [B, H, Q, hd]
    S = batch.kv_slots.shape[1]
    flat = batch.kv_slots.reshape(-1)  # index_select: advanced indexing is ~1000x slower on CPU
    kp = k_cache.index_select(0, flat).view(B, S, *k_cache.shape[1:]).transpose(1, 2)  # [B, KVH, S, hd]
    vp = v_cache.index_select(0, flat).view(B, S, *v_cache.shape[1:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=batch.attn_mask, enable_gqa=True)
    out = out.transpose(1, 2).reshape(B * Q, H, hd)
    return out if batch.dense else out.index_select(0, batch.q_dest)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.inter = args.intermediate_size
        self.gate_up = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).split([self.inter, self.inter], dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args)
        self.post_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, batch, k_cache, v_cache):
        x = x + self.attn(self.input_norm(x), cos, sin, batch, k_cache, v_cache)
        return x + self.mlp(self.post_norm(x))


class Transformer(nn.Module):
    """Decoder-only transformer; returns logits for each sequence's last new token."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        for i, layer in enumerate(self.layers):
            layer.attn.layer_id = i
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, input_ids, positions, cos_table, sin_table, batch: StepBatch, kv_cache):
        # input_ids, positions: [T]; kv_cache: [L, 2, num_slots, KVH, hd] -> logits [B, V]
        x = self.embed(input_ids)
        cos, sin = cos_table[positions], sin_table[positions]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, batch, kv_cache[i, 0], kv_cache[i, 1])
        x = self.norm(x.index_select(0, batch.logits_index))
        if self.lm_head is None:  # tied
            return F.linear(x, self.embed.weight).float()
        return self.lm_head(x).float()  # nn.Linear, or a quantized copy (of the embedding when tied)


def hf_weight_map(args: ModelArgs) -> dict[str, list[str]]:
    """Our parameter name -> the Hugging Face tensor names concatenated (dim 0) to make it."""
    names = {"embed.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not args.tie_word_embeddings:
        names["lm_head.weight"] = ["lm_head.weight"]
    for i in range(args.num_layers):
        hf, our = f"model.layers.{i}.", f"layers.{i}."
        names[our + "input_norm.weight"] = [hf + "input_layernorm.weight"]
        names[our + "post_norm.weight"] = [hf + "post_attention_layernorm.weight"]
        names[our + "attn.qkv.weight"] = [hf + f"self_attn.{p}_proj.weight" for p in "qkv"]
        if args.attention_bias:
            names[our + "attn.qkv.bias"] = [hf + f"self_attn.{p}_proj.bias" for p in "qkv"]
        names[our + "attn.o.weight"] = [hf + "self_attn.o_proj.weight"]
        if args.qk_norm:
            names[our + "attn.q_norm.weight"] = [hf + "self_attn.q_norm.weight"]
            names[our + "attn.k_norm.weight"] = [hf + "self_attn.k_norm.weight"]
        names[our + "mlp.gate_up.weight"] = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
        names[our + "mlp.down.weight"] = [hf + "mlp.down_proj.weight"]
    return names
