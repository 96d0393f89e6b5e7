"""The decoder in the form ONNX runtimes want: dense per-layer KV tensors as explicit inputs and outputs.

The engine's own forward reads and writes a paged KV pool through slot tables; an exported graph
instead takes each layer's past keys and values ([B, KVH, P, hd], after RoPE) and returns them with
the new tokens appended, as Hugging Face's ONNX exports do, so any ONNX runtime (and TensorRT through
its ONNX parser) can run it. The math is the engine's, on the engine's own modules and weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from o3edge.engine.model import Transformer
from o3edge.engine.rope import apply_rope


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Input and output names of the exported graph."""
    past = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return ["input_ids", "position_ids", "attention_mask", *past], ["logits", *present]


class OnnxDecoder(nn.Module):
    """forward(input_ids [B,T], position_ids [B,T], attention_mask [B,P+T], *past) -> logits [B,T,V], *present."""

    def __init__(self, model: Transformer, cos: torch.Tensor, sin: torch.Tensor):
        super().__init__()
        self.model = model
        self.register_buffer("cos", cos, persistent=False)  # [max_len, hd]
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, input_ids, position_ids, attention_mask, *past):
        m = self.model
        B, T = input_ids.shape
        x = m.embed(input_ids)  # [B, T, D]
        cos, sin = self.cos[position_ids], self.sin[position_ids]  # [B, T, hd]
        P = past[0].shape[2]
        # key j is visible to query i when it is a real token and not in the future: [B, 1, T, P+T]
        key_pos = torch.arange(P + T, device=x.device)[None, None, :]
        causal = key_pos <= (P + torch.arange(T, device=x.device))[None, :, None]
        visible = (causal & attention_mask[:, None, :].bool())[:, None]
        bias = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill(~visible, torch.finfo(x.dtype).min)
        presents = []
        for i, layer in enumerate(m.layers):
            h, (k, v) = self._attention(layer, layer.input_norm(x), cos, sin, bias, past[2 * i], past[2 * i + 1])
            x = x + h
            x = x + layer.mlp(layer.post_norm(x))
            presents += [k, v]
        x = m.norm(x)
        weight = m.embed.weight if m.lm_head is None else m.lm_head.weight
        return (F.linear(x, weight).float(), *presents)

    @staticmethod
    def _attention(layer, x, cos, sin, bias, past_k, past_v):
        a = layer.attn
        B, T, _ = x.shape
        H, KVH, hd = a.num_heads, a.num_kv_heads, a.head_dim
        qkv = a.qkv(x).view(B, T, H + 2 * KVH, hd)
        q, k, v = qkv[:, :, :H], qkv[:, :, H:H + KVH], qkv[:, :, H + KVH:]
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        q = apply_rope(q.reshape(B * T, H, hd), cos.reshape(B * T, hd), sin.reshape(B * T, hd)).view(B, T, H, hd)
        k = apply_rope(k.reshape(B * T, KVH, hd), cos.reshape(B * T, hd), sin.reshape(B * T, hd)).view(B, T, KVH, hd)
        k = torch.cat((past_k, k.transpose(1, 2)), dim=2)  # [B, KVH, P+T, hd]
        v = torch.cat((past_v, v.transpose(1, 2)), dim=2)
        rep = H // KVH
        kk = k.repeat_interleave(rep, dim=1) if rep > 1 else k
        vv = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        scores = torch.matmul(q.transpose(1, 2), kk.transpose(2, 3)) * hd ** -0.5 + bias  # [B, H, T, P+T]
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, vv).transpose(1, 2).reshape(B, T, H * hd)
        return a.o(out), (k, v)
