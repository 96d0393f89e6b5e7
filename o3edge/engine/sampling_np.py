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
    stable descending order, looked for among the 64 most probable first (all tokens as probable as the last
    of them), then, when those do not leave one out, by bins of probability (_nucleus_by_bins). On this
    project's 2-core CPU machine a top-p draw over 49,152 logits took 5.0-5.6 ms with the sort of the
    vocabulary; now 0.38-0.8 ms when the nucleus is small (logits from N(0, 3²) at T 0.7: 17 tokens) and
    2.3 ms when it is most of the vocabulary (N(0, 1): 21,605 tokens; 8.7 ms with the rounds of larger
    guesses this replaced) (tools/bench_sampling.py --numpy [--scale 1], docs/benchmarks.md)."""
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
    n = probs.shape[0]
    if n > FIRST_GUESS:  # the most probable first: a trained model's nucleus is mostly this small
        sub = np.flatnonzero(probs >= np.partition(probs, n - FIRST_GUESS)[n - FIRST_GUESS])
        order = sub[np.argsort(-probs[sub], kind="stable")]  # sub ascends: ties in token order, as a full sort
        ranked, keep = _prefix(probs, order, p.top_p)
        if not keep.all():
            return ids[order[keep]], ranked[keep]
    if n <= SORTED_BELOW:
        order = np.argsort(-probs, kind="stable")
        ranked, keep = _prefix(probs, order, p.top_p)
    else:
        order, ranked, keep = _nucleus_by_bins(probs, p.top_p)
    return ids[order[keep]], ranked[keep]


def _prefix(probs: np.ndarray, order: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(probs in `order`, most probable first, and which of them top-p keeps: those whose mass before them is
    under top_p)."""
    ranked = probs[order]
    return ranked, np.cumsum(ranked) - ranked < top_p


FIRST_GUESS = 64  # top-p looks among this many most probable tokens first
SORTED_BELOW = 2048  # rows this short are sorted whole: as fast as the bins


def _nucleus_by_bins(probs: np.ndarray, top_p: float, per_octave_bits: int = 5, bins: int = 4096):
    """Top-p's tokens without a sort of the vocabulary: (tokens, their probabilities, which are kept).
    Each probability's bin is its float64 bit pattern's top bits (exponent and the first per_octave_bits
    of the mantissa: 32 bins an octave, exact in the probability's order), counted down from the most
    probable's and floored at `bins` (probabilities below 2^-128 of the largest share the lowest); the bin
    where the mass from the top reaches top_p is the only one whose tokens are sorted: every token of a
    higher bin is kept, none of a lower one. Equal to the definition's stable sort but for the order the
    mass above a token is summed in (a token whose mass before it is within float64 rounding of top_p could
    be decided the other way)."""
    key = probs.view(np.int64) >> (52 - per_octave_bits)  # rises with the probability (positive floats)
    b = np.maximum(key - (int(key.max()) - (bins - 1)), 0)
    mass = np.bincount(b, weights=probs, minlength=bins)
    reach = np.cumsum(mass[::-1])[::-1]  # reach[c]: the mass of bins c and above
    c = max(int(np.count_nonzero(reach >= top_p)) - 1, 0)
    above = reach[c + 1] if c + 1 < bins else 0.0
    inside = np.flatnonzero(b == c)
    inside = inside[np.argsort(-probs[inside], kind="stable")]  # ties in token order, as a full sort
    higher = np.flatnonzero(b > c)
    order = np.concatenate((higher, inside))
    keep = np.ones(order.shape[0], dtype=bool)
    tail = probs[inside]
    keep[higher.shape[0]:] = above + np.cumsum(tail) - tail < top_p
    return order, probs[order], keep


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
