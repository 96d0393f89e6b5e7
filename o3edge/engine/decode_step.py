"""The whole CUDA decode step on fused kernels: what one decode graph (cuda_graph.py) captures.

Per layer, at batch 1:
  1. residual add + RMSNorm fused into the QKV projection (kernels/gemv.py),
  2. RoPE + KV-cache write + paged attention (kernels/decode_attention.py; + a split merge),
  3. the output projection,
  4. residual add + RMSNorm fused into the gate/up projection,
  5. SiLU·mul fused into the down projection;
then the final norm fused into the LM head, and the float32 logits with their greedy token. Larger
batches (or `fused=False`) run the same step with the norm and SiLU·mul as kernels of their own and
the projections on cuBLAS (or the INT4 or INT8 module's own path, kernels/int4_matmul.py and
int8_matmul.py); an INT4 gate/up projection on tiles ends in SiLU·mul itself (silu_epilogue).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from o3edge.engine.cpu_quant import Int8Linear
from o3edge.engine.quant import Int4Linear


def _weights(mod) -> dict:
    """skinny_matmul's weight arguments for a projection (nn.Linear, Int4Linear, Int8Linear, or a tied
    embedding)."""
    if isinstance(mod, Int4Linear):
        return dict(weight=mod.weight, scales_and_zeros=mod.scales_and_zeros, group_size=mod.group_size,
                    out_features=mod.out_features)
    if isinstance(mod, Int8Linear):
        return dict(weight=mod.weight, scales8=mod.scales)
    return dict(weight=mod.weight, bias=getattr(mod, "bias", None))


def _apply(mod, x):
    return F.linear(x, mod.weight) if isinstance(mod, torch.nn.Embedding) else mod(x)


def skinny_ok(mod, rows: int) -> bool:
    """Whether this projection runs on the skinny kernel with the op before fused in: at one row.

    Above one row, each program would re-read (and re-normalize) every activation row, which cost
    more than the launch it saves (tools/bench_gemv.py): the op runs as its own kernel and the
    projection on cuBLAS (dense) or on the module's own path (INT4: the skinny kernel without a
    prologue up to gemv.MAX_ROWS rows). For INT4 tiles this was timed on the H200 (2026-12-01, the op
    fused into tiles of 8 and 32 rows: docs/results/gpu-2026-12-01f/same-run/gemv-fuse*.json): tinyllama
    gate/up 17.3 -> 23.5 us at 8 rows, down 13.2 -> 40.1; llama-1b down 15.9 -> 75.6."""
    if isinstance(mod, Int4Linear):
        return mod.neutral and rows == 1
    if isinstance(mod, Int8Linear):
        return mod.kernel == "triton" and rows == 1
    return isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)) and rows == 1


def silu_epilogue(mod, rows: int) -> bool:
    """Whether an INT4 gate/up projection of `rows` rows makes SiLU(gate) * up in its tiles' epilogue
    (gemv.skinny_matmul silu_out), so that no SiLU·mul kernel runs after it: where it runs on tiles (2-64
    rows, not streamed), unless O3EDGE_INT4_SILU_EPILOGUE=0. On the H200 (tools/bench_gpu.py --shape
    tinyllama-1.1b --dtype float16 --int4 --batches 4,8,32, off and on twice in one call;
    docs/results/gpu-2026-12-03f/silu-epilogue/), INT4-FFN decode at batch 32 went from 25,263-25,490 to
    27,088-27,193 tok/s (fp16 24,674-24,892 in the same runs), at 8 from 7,230-7,242 to 7,276-7,285. At one row
    (gate/up's streamed row blocks holding gate rows and their up rows, down reading the product instead of making
    it in each program's prologue) it was tried and not kept (docs/results/gpu-2026-12-04-fifteenth/): the graph
    step of tinyllama-1.1b with every linear INT4 0.471 -> 0.457 ms but fp16 0.758 -> 0.767, and whole generations
    with every linear INT4 2,155 -> 2,170 tok/s at 4.87 tokens per joule against 5.02-5.03 (the board drew ~446 W
    against ~429)."""
    from o3edge.engine.kernels.gemv import MAX_ROWS, rows_int4

    return (isinstance(mod, Int4Linear) and mod.neutral and 1 < rows <= MAX_ROWS and not rows_int4(rows)
            and os.environ.get("O3EDGE_INT4_SILU_EPILOGUE", "1") != "0")


class Step:
    """The projections of one decode step, each with the op before it fused in where it can be."""

    def __init__(self, eps: float, rows: int, fused: bool):
        self.eps, self.rows, self.fused = eps, rows, fused

    def norm_linear(self, x, residual, norm_weight, mod):
        """(mod(RMSNorm(x + residual) * norm_weight), the new residual stream)."""
        if self.fused and skinny_ok(mod, self.rows):
            from o3edge.engine.kernels.gemv import skinny_matmul

            return skinny_matmul(x, norm_weight=norm_weight, residual=residual, eps=self.eps, **_weights(mod))
        y, residual = self._add_norm(x, residual, norm_weight)
        return _apply(mod, y), residual

    def _add_norm(self, x, residual, norm_weight):
        """(RMSNorm(x + residual) * norm_weight by its own kernel, the new residual stream)."""
        from o3edge.engine.kernels.norm import add_rmsnorm

        y = add_rmsnorm(x, residual, norm_weight, self.eps)  # updates residual in place
        return y, (x if residual is None else residual)

    def mlp(self, x, residual, norm_weight, mlp):
        """(down(SiLU(gate) * up) of the gate/up projection of RMSNorm(x + residual) * norm_weight, the new
        residual stream)."""
        if self.fused and silu_epilogue(mlp.gate_up, self.rows):
            from o3edge.engine.kernels.gemv import skinny_matmul

            y, residual = self._add_norm(x, residual, norm_weight)
            return _apply(mlp.down, skinny_matmul(y, silu_out=True, **_weights(mlp.gate_up))), residual
        gate_up, residual = self.norm_linear(x, residual, norm_weight, mlp.gate_up)
        return self.silu_linear(gate_up, mlp.down), residual

    def silu_linear(self, gate_up, mod):
        if self.fused and skinny_ok(mod, self.rows):
            from o3edge.engine.kernels.gemv import skinny_matmul

            return skinny_matmul(gate_up, silu=True, **_weights(mod))
        from o3edge.engine.kernels.activation import silu_mul

        return mod(silu_mul(gate_up))

    def linear(self, x, mod):
        if self.fused and skinny_ok(mod, self.rows):
            from o3edge.engine.kernels.gemv import skinny_matmul

            return skinny_matmul(x, **_weights(mod))
        return mod(x)


def decode_forward(model, meta: torch.Tensor, cos, sin, kv_cache, block_size: int, num_splits: int,
                   fused: bool = True, attention=None, last: torch.Tensor | None = None):
    """meta [B, 3 + blocks] -> (logits [B, V] float32, greedy tokens [B]). `attention`, when given,
    replaces decode_attention: attention(layer, qkv, cos, sin, meta, heads, splits, q_norm, k_norm, eps)
    (the token router's two-pool step, router_graph.py). `last`, when given: a metadata token -(r + 1)
    is row r of it (the step before's greedy tokens, kernels/embedding.py), and this step's greedy tokens
    are written into it."""
    from o3edge.engine.kernels.argmax import float_logits_and_argmax
    from o3edge.engine.kernels.decode_attention import decode_attention

    eps = model.args.rms_norm_eps
    step = Step(eps, meta.shape[0], fused)
    if last is None:
        h = model.embed(meta[:, 0])  # [B, D]
    else:
        from o3edge.engine.kernels.embedding import embed_rows

        h = embed_rows(model.embed.weight, meta, last)
    residual = None
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        qkv, residual = step.norm_linear(h, residual, layer.input_norm.weight, attn.qkv)
        qn, kn = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
        if attention is None:
            o = decode_attention(qkv, cos, sin, meta, kv_cache[i, 0], kv_cache[i, 1], attn.num_heads,
                                 block_size, num_splits, qn, kn, eps)
        else:
            o = attention(i, qkv, cos, sin, meta, attn.num_heads, num_splits, qn, kn, eps)
        h, residual = step.mlp(step.linear(o, attn.o), residual, layer.post_norm.weight, layer.mlp)
    head = model.embed if model.lm_head is None else model.lm_head
    logits, _ = step.norm_linear(h, residual, model.norm.weight, head)
    return float_logits_and_argmax(logits, None if last is None else last[:meta.shape[0]])
