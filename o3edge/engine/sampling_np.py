"""Choosing the next token from float32 logits in NumPy: the native backend's sampler (no torch).

The same rules as sampling.py: temperature, then top-k, then top-p (the smallest set of tokens whose
mass reaches top_p; the first always stays), and a row's randomness from its request's own generator (one
uniform number a token, through the inverse of the kept tokens' cumulative distribution), so a request's
tokens depend on its seed alone, never on the rest of the batch. The generators and the way of drawing
differ from torch's, so a seed gives other (equally distributed) tokens on the torch backend.
"""

from __future__ import annotations

import numpy as np

from o3edge.engine.sequence import SamplingParams


def make_rng(params: SamplingParams, fallback_seed: int) -> np.random.Generator | None:
    """A private random stream per request; None for greedy ones."""
    if params.greedy:
        return None
    return np.random.default_rng(params.seed if params.seed is not None else fallback_seed)


def sample(logits: np.ndarray, params: list[SamplingParams], rngs: list) -> list[int]:
    """logits: [B, V] float32 -> one token id per row."""
    tokens = logits.argmax(axis=-1).tolist()
    for i, (p, rng) in enumerate(zip(params, rngs)):
        if not p.greedy:
            ids, probs = kept(logits[i], p)
            cdf = np.cumsum(probs)  # one uniform number a draw, not noise for every kept token
            tokens[i] = int(ids[min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(ids) - 1)])
    return tokens


def kept(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, their probabilities up to a common factor): the tokens filtered_probs keeps, found without
    sorting the vocabulary. Top-k's tokens are those at least the k-th logit; top-p's are a prefix of the
    stable descending order, looked for among the 64 most probable (all tokens as probable as the last of
    them), then more (at least 8 times as many, or twice what their mass says it takes; all of them past a
    quarter of the vocabulary) until one is left out. On this project's 2-core CPU machine a top-p draw over
    49,152 peaked logits took 5.0 ms with the sort, 0.38 now; over flat logits, whose nucleus is most of the
    vocabulary, the search ends in that sort (tools/bench_sampling.py --numpy, docs/benchmarks.md)."""
    x = logits.astype(np.float64) / p.temperature
    V = x.shape[0]
    ids = np.arange(V)
    if 0 < p.top_k < V:
        ids = np.flatnonzero(x >= np.partition(x, V - p.top_k)[V - p.top_k])
        x = x[ids]
    probs = np.exp(x - x.max())
    if p.top_p >= 1.0:
        return ids, probs
    probs /= probs.sum()
    n, m = probs.shape[0], 64
    while True:
        sub = np.flatnonzero(probs >= np.partition(probs, n - m)[n - m]) if m < n else np.arange(n)
        order = sub[np.argsort(-probs[sub], kind="stable")]  # sub ascends: ties in token order, as a full sort
        ranked = probs[order]
        keep = np.cumsum(ranked) - ranked < p.top_p
        if not keep.all() or m >= n:
            return ids[order[keep]], ranked[keep]
        m = max(8 * m, int(2 * m * p.top_p / ranked.sum()))  # twice as many as their mass says it takes
        if m > n // 4:  # a flat distribution: one sort of everything costs less than more rounds
            m = n


def filtered_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """[V] probabilities of one row after temperature, top-k and top-p."""
    x = logits.astype(np.float64) / p.temperature
    V = x.shape[0]
    if 0 < p.top_k < V:
        kth = np.partition(x, V - p.top_k)[V - p.top_k]
        x = np.where(x < kth, -np.inf, x)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        ranked = probs[order]
        drop = np.cumsum(ranked) - ranked >= p.top_p
        probs[order[drop]] = 0.0
    return probs


def pick_tokens(batch, logits, generator_for, sample_rows=sample) -> list[int | None]:
    """A token for each (sequence, new tokens) row whose prompt this step finishes (None elsewhere);
    sample_rows(logits of those rows, their params, their generators) picks (sampling.py passes its own)."""
    done = [i for i, (seq, n) in enumerate(batch) if seq.num_computed_tokens + n == len(seq)]
    tokens: list[int | None] = [None] * len(batch)
    if done:
        seqs = [batch[i][0] for i in done]
        rows = logits if len(done) == len(batch) else logits[done]  # decodes: every row, no copy
        for i, tok in zip(done, sample_rows(rows, [s.params for s in seqs], [generator_for(s) for s in seqs])):
            tokens[i] = tok
    return tokens
