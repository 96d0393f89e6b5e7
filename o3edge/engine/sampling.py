"""Choosing the next token from logits: greedy, or temperature with top-k and top-p, for a whole batch.

Every row is filtered and sampled with batched tensor operations and the batch's tokens reach the host
in one copy, so a step of sampled requests costs a few kernels, not a few per row. A row draws its
randomness from its request's own generator (exponential noise over the vocabulary, then the
"exponential race": argmax of p / E is a draw from p), so its tokens depend only on its seed, never on
what else is in the batch. With graph sampling (cuda_graph.py: a CUDA engine's default, O3EDGE_GRAPH_SAMPLING=0
turns it off) a CUDA engine draws by counter_sample instead, on every path: the noise a function of the
request's seed and the row's position (kernels/noise.py), the filter of fixed shapes, so that a CUDA graph
can hold it.
"""

from __future__ import annotations

import torch

from o3edge.engine import sampling_np
from o3edge.engine.sequence import SamplingParams


def make_generator(params: SamplingParams, device: torch.device, fallback_seed: int) -> torch.Generator | None:
    """A private random stream per request, so its output depends only on its own seed."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """logits: [B, V] float32 -> one token id per row. The rows' settings reach the device in one copy and
    nothing is read back before the tokens (a CUDA copy from pageable memory waits for the device, and
    testing a device value syncs): before, one sampled row took 51 eager operations and five such copies."""
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy.tolist()
    cfg, kmax, top_p = _settings(params, logits.shape[1], logits.device)
    probs = _filtered(logits, cfg, kmax, top_p)  # [B, V]
    noise = torch.ones_like(probs)
    for row, g in zip(noise, generators):  # each request's own stream, in row order
        if g is not None:
            row.exponential_(generator=g)
    drawn = (probs / noise).argmax(dim=-1)
    return torch.where(cfg[:, 3] > 0, greedy, drawn).tolist()


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[B, V] probabilities after temperature, top-k and top-p (greedy rows: any valid distribution)."""
    return _filtered(logits, *_settings(params, logits.shape[1], logits.device))


def _settings(params: list[SamplingParams], V: int, device) -> tuple[torch.Tensor, int, bool]:
    """(float32 [B, 4] on device: each row's temperature, the index of its k-th largest logit among the
    kmax largest (-1: no top-k), top_p, greedy or not; kmax; whether any row has top_p < 1), in one copy."""
    ks = [p.top_k if 0 < p.top_k < V else V for p in params]
    kmax = max((k for k in ks if k < V), default=0)
    cfg = torch.tensor([[p.temperature if not p.greedy else 1.0, min(k, kmax) - 1 if k < V else -1, p.top_p,
                         float(p.greedy)] for p, k in zip(params, ks)], dtype=torch.float32)
    return cfg.to(device), kmax, any(p.top_p < 1.0 for p in params)


def _filtered(logits: torch.Tensor, cfg: torch.Tensor, kmax: int, top_p: bool) -> torch.Tensor:
    x = logits / cfg[:, :1]
    if kmax:
        top = torch.topk(x, kmax, dim=-1).values  # [B, kmax], descending
        kth = top.gather(1, cfg[:, 1:2].clamp_min(0).long()).masked_fill_(cfg[:, 1:2] < 0, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest set whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= cfg[:, 2:3]
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


# counter sampling (DecodeGraphs with graph sampling): a row's settings as float32 columns
TEMPERATURE, KTH, TOP_P, GREEDY, METHOD = range(5)
# how counter_sample draws a row, chosen by the row's own settings (never by the batch): over the whole
# vocabulary with no filter (RACE), over the TOP_K_CAP largest logits (a top-k of at most that many, with or
# without top-p), or over the whole vocabulary past a cut found by selection, without a sort (NUCLEUS: top-p
# alone; WIDE_TOPK: a larger top-k, with or without top-p)
RACE, TOPK, WIDE_TOPK, NUCLEUS = range(4)
TOP_K_CAP = 64


def counter_settings(params: list[SamplingParams], V: int) -> list[list[float]]:
    """counter_sample's settings rows: temperature (1 when greedy), the index of the k-th largest logit
    (V - 1 without top-k), top_p (2: none, so that rounding never drops a token), greedy or not, method."""
    rows = []
    for p in params:
        k = p.top_k if 0 < p.top_k < V else V
        method = (RACE if k == V and p.top_p >= 1.0 else TOPK if k <= min(TOP_K_CAP, V) else NUCLEUS if k == V
                  else WIDE_TOPK)
        rows.append([p.temperature if not p.greedy else 1.0, k - 1, p.top_p if p.top_p < 1.0 else 2.0,
                     float(p.greedy), float(method)])
    return rows


def ways_needed(rows: list[list[float]]) -> dict:
    """counter_sample's flags for a batch of counter_settings rows: only the ways some row takes."""
    methods = {row[METHOD] for row in rows}
    return dict(topk=TOPK in methods, nucleus=bool({NUCLEUS, WIDE_TOPK} & methods), wide=WIDE_TOPK in methods)


def sampling_graph(rows: list[list[float]]) -> int:
    """Which draw a batch of counter_settings rows needs: 3 with a WIDE_TOPK row (the cut, after the k-th largest
    is selected), 2 with a NUCLEUS row (the cut), else 1 (RACE and TOPK rows only)."""
    ways = ways_needed(rows)
    return 3 if ways["wide"] else 2 if ways["nucleus"] else 1


def counter_sample(logits: torch.Tensor, greedy: torch.Tensor, cfg: torch.Tensor, seeds: torch.Tensor,
                   counters: torch.Tensor, topk: bool = True, nucleus: bool = True,
                   wide: bool = True) -> torch.Tensor:
    """Tokens [B] (int64) for logits [B, V] float32, with fixed shapes and no host sync, so a CUDA graph can
    hold it: greedy rows keep `greedy` (their argmax), sampled rows draw from the same distribution as
    `sample` (temperature, then top-k, then top-p over the sorted probabilities) by the exponential race in
    its Gumbel-max form with counter noise (kernels/noise.py): row r's draw depends only on (seeds[r],
    counters[r]), its settings and its logits. A row's METHOD says which of four ways computes it (one
    pass with no filter, the TOP_K_CAP largest logits, a cut found by selection for top-p alone, the same after
    the k-th largest is selected for a larger top-k: kernels/counter_draw.py, kernels/nucleus.py); topk=False,
    nucleus=False or wide=False leaves that way out, for batches with no such row. cfg: float32 [B, 5]
    (counter_settings); seeds int64 [B]; counters [B] (a sequence's position)."""
    from o3edge.engine.kernels.counter_draw import draw

    return draw(logits, greedy, cfg, seeds, counters, topk, nucleus, wide)


def pick_tokens(batch, logits: torch.Tensor, generator_for, sample_rows=sample) -> list[int | None]:
    """A token for each (sequence, new tokens) row whose prompt this step finishes (None elsewhere);
    sample_rows(those rows' logits, their params, generator_for of their sequences) picks them."""
    return sampling_np.pick_tokens(batch, logits, generator_for, sample_rows)
