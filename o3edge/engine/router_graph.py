"""The token router's decode steps on the CUDA-graph path (cuda_graph.py), off unless asked for.

A router decode step is the plain graph step (decode_step.py) with each layer's attention replaced by
kernels/quant_attention.router_decode_attention: RoPE, the K/V write, and attention over the
sequence's full-precision blocks and its compressed blocks, merged by log-sum-exp, all inside the
captured graph. Its metadata rows are wider: the full-precision block table is compacted (the
compressed blocks left out) and the compressed blocks get a table of their own. Steps that observe
attention for saliency (every `refresh_steps`-th router step, the same for every sequence; none
with threshold 0) need the probabilities, so they run eager (router.py), as do prefills. No step is
launched ahead: the router's demotions change block tables between steps.
"""

from __future__ import annotations

from o3edge.engine.cuda_graph import DecodeGraphs
from o3edge.engine.decode_step import decode_forward


class RouterDecodeGraphs(DecodeGraphs):
    """DecodeGraphs for a router-on runner (runner.router is the KVRouter)."""

    def __init__(self, runner, max_batch: int, capture: bool):
        super().__init__(runner, max_batch, capture, launch_ahead=False)

    def meta_columns(self) -> int:
        """token, position, slot, full-precision keys before the token, compressed blocks, then the
        compacted full-precision table and the compressed table (max_blocks each)."""
        return 5 + 2 * self.max_blocks

    def fits(self, batch) -> bool:
        return super().fits(batch) and not self.runner.router.observes(batch)

    def _attention(self, layer, qkv, cos, sin, meta, heads, splits, q_norm, k_norm, eps):
        from o3edge.engine.kernels.quant_attention import router_decode_attention

        r, kv = self.runner.router, self.runner.kv_cache
        return router_decode_attention(qkv, cos, sin, meta, kv[layer, 0], kv[layer, 1], r.codes[layer],
                                       r.scales[layer], r.rotation, r.cfg.mode, heads, self.block_size, splits,
                                       q_norm, k_norm, eps)

    def _forward(self, B: int):
        r = self.runner
        return decode_forward(r.model, self.meta[:B], r.cos, r.sin, r.kv_cache, self.block_size, self.splits[B],
                              self.fused, attention=self._attention)

    def fill_meta(self, meta, batch, B: int, ahead: int) -> None:
        assert ahead == 0  # no launch ahead (see the module's docstring)
        bs, mb, nf = self.block_size, self.max_blocks, self.runner.router.num_full_blocks
        for b, (seq, _) in enumerate(batch):
            pos = seq.num_computed_tokens
            table = seq.block_table[:pos // bs + 1]
            full = [x for x in table if x < nf]
            comp = [x - nf for x in table if x >= nf]
            meta[b, :5] = (seq.token_ids[pos], pos, table[-1] * bs + pos % bs, pos - len(comp) * bs, len(comp))
            meta[b, 5:5 + len(full)] = full
            meta[b, 5 + mb:5 + mb + len(comp)] = comp
        meta[len(batch):B, :5] = (0, 0, self.runner.scratch_slot, 0, 0)  # padding rows: scratch slot, self only
