"""The engine's runner for `backend = "native"`: a quantized CPU engine served without torch.

`import torch` alone costs a process ~218 MB of resident memory, more than a small model's weights. This
runner needs none of it: every step, prefill chunks and decodes alike, is one call into o3edge's native
step (cpu_core.cpp through native_lib.py, the same code the torch backend's native decode step runs),
the weights are NumPy arrays packed from the engine file (native_weights.py), the KV pool is a NumPy
array over anonymous memory, and sampling is NumPy (sampling_np.py).

The step takes every row of a batch at once: each row has its own position, cache slot and block table,
all rows write their keys and values before any row attends, so a prompt chunk is exact causal attention
over its own new keys and the cached prefix (prefix-cache hits included), and decodes of other sequences
ride in the same call. Logits are computed for each sequence's last row only.

Same scheduler, block manager (prefix reuse included), shared-memory cold tier (kv_offload.py copies
this pool's bytes as it does the torch backend's CPU pool), protocol, limits and energy accounting as
the torch backend. Not here: the token router and CUDA (the engine refuses them with a ConfigError),
dense engines' exact-against-transformers arithmetic (dense linears are quantized to INT8 at load;
build with a CPU preset for its precision report), and seeded sampled tokens equal to the torch
backend's (the generators differ; a seed still reproduces its tokens on this backend).
"""

from __future__ import annotations

import math
import mmap
import time

import numpy as np

from o3edge.engine.checkpoint import ModelArgs
from o3edge.engine.manifest import Manifest
from o3edge.engine.native_weights import load_native_model
from o3edge.engine.sampling_np import make_rng, pick_tokens
from o3edge.engine.sequence import Sequence
from o3edge.engine.threads import ThreadProbe


def kv_block_bytes(args: ModelArgs, block_size: int) -> int:
    """Bytes one float32 KV block takes across all layers."""
    return args.num_layers * 2 * block_size * args.num_kv_heads * args.head_dim * 4


def lazy_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """float32 zeros in anonymous memory whose pages the OS maps on first write: the KV pool adds to
    resident memory only as the cache fills."""
    n = math.prod(shape)
    return np.frombuffer(mmap.mmap(-1, max(4 * n, 1)), dtype=np.float32, count=n).reshape(shape)


def rope_tables(args: ModelArgs, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [max_len, head_dim] (rotate-half layout), with linear and Llama-3 scaling: rope.py's
    tables, computed as it (and transformers) does, in float32 (within an ulp of its cos and sin)."""
    f32 = np.float32
    dim = args.head_dim
    # the power rounded once to float32 (as torch's is), then a float32 reciprocal
    inv_freq = f32(1.0) / (args.rope_theta ** (np.arange(0, dim, 2).astype(f32) / f32(dim)).astype(np.float64)).astype(f32)
    s = args.rope_scaling
    if s is not None and s["rope_type"] == "linear":
        inv_freq = inv_freq / f32(s["factor"])
    elif s is not None:  # Llama-3.1: long wavelengths slowed, short kept, smooth between
        factor, low, high = f32(s["factor"]), f32(s["low_freq_factor"]), f32(s["high_freq_factor"])
        old = f32(s["original_max_position_embeddings"])
        wavelen = f32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv_freq = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled).astype(f32)
    freqs = np.outer(np.arange(max_len).astype(f32), inv_freq)
    emb = np.concatenate((freqs, freqs), axis=-1)
    return np.cos(emb), np.sin(emb)


class NativeRunner:
    """runner.run / prompt_logits / release over the native step (see the module docstring)."""

    device = "cpu"
    model = graphs = prefill_graphs = router = None  # the torch runner's optional parts: none here

    def __init__(self, manifest: Manifest, num_blocks: int, block_size: int, max_model_len: int, threads: int,
                 seed: int = 0):
        args = manifest.args
        self.args, self.block_size, self.num_blocks = args, block_size, num_blocks
        self.native = load_native_model(manifest)
        self.cos, self.sin = rope_tables(args, max_model_len)
        # [layers, K/V, slots, kv_heads, head_dim], the torch runner's layout (one spare block at the end)
        self.kv_cache = lazy_zeros((args.num_layers, 2, (num_blocks + 1) * block_size, args.num_kv_heads,
                                    args.head_dim))
        self.threads = threads
        self.probe = ThreadProbe(threads)  # decode steps: all threads, or one while other processes hold the cores
        self.rngs: dict[int, np.random.Generator | None] = {}
        self._seed = seed
        self.last_logits: np.ndarray | None = None

    def run(self, batch: list[tuple[Sequence, int]], kv_ready=None) -> list[int | None]:
        """Compute the new tokens' K/V (one native call for the whole batch) and sample a token for each
        sequence whose prompt is now done."""
        ids, positions, slots, tables, last = self.rows(batch)
        if kv_ready is not None:
            kv_ready()
        decode = len(ids) == len(batch)
        n = self.probe.pick() if decode else self.threads
        t = time.perf_counter()
        logits = self.native.step(ids, positions, slots, tables, self.block_size, self.cos, self.sin, self.kv_cache,
                                  last, threads=n)
        if decode:
            self.probe.timed(n, time.perf_counter() - t)
        self.last_logits = logits  # [B, V]: each sequence's last row (kept for tests and reports)
        return pick_tokens(batch, logits, self._rng)

    def weights_bytes(self) -> int:
        return self.native.nbytes

    def prompt_logits(self, seq: Sequence) -> np.ndarray:
        """Float32 logits at every position of seq's uncomputed tokens: [n, V] (perplexity, reports)."""
        ids, positions, slots, tables, _ = self.rows([(seq, seq.num_uncomputed)])
        return self.native.step(ids, positions, slots, tables, self.block_size, self.cos, self.sin, self.kv_cache,
                                np.arange(len(ids), dtype=np.int64), threads=self.threads)

    def rows(self, batch: list[tuple[Sequence, int]]):
        """The step's rows: ids, positions, cache slots, block-table rows [rows, width] (int64), and the
        index of each sequence's last row."""
        bs = self.block_size
        counts = [n for _, n in batch]
        starts = [seq.num_computed_tokens for seq, _ in batch]
        width = max(-(-(s + n) // bs) for s, n in zip(starts, counts))
        table = np.zeros((len(batch), width), dtype=np.int64)
        for b, (seq, _) in enumerate(batch):
            row = seq.block_table[:width]
            table[b, :len(row)] = row
        if len(counts) == sum(counts):  # decodes only (most steps): one row a sequence, no gathers
            positions = np.array(starts, dtype=np.int64)
            ids = np.array([seq.token_ids[p] for (seq, _), p in zip(batch, starts)], dtype=np.int64)
            slots = table[np.arange(len(batch)), positions // bs] * bs + positions % bs
            return ids, positions, slots, table, np.arange(len(batch), dtype=np.int64)
        ids = np.concatenate([np.asarray(seq.token_ids[s:s + n], dtype=np.int64)
                              for (seq, n), s in zip(batch, starts)])
        owner = np.repeat(np.arange(len(batch)), counts)
        positions = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, counts)])
        slots = table[owner, positions // bs] * bs + positions % bs
        last = np.cumsum(counts, dtype=np.int64) - 1
        return ids, positions, slots, np.ascontiguousarray(table[owner]), last

    def _rng(self, seq: Sequence):
        if seq.seq_id not in self.rngs:
            self.rngs[seq.seq_id] = make_rng(seq.params, self._seed + seq.seq_id)
        return self.rngs[seq.seq_id]

    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence's random stream."""
        self.rngs.pop(seq.seq_id, None)
