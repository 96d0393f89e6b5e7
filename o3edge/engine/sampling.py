"""Choosing the next token from logits: greedy, or temperature with top-k and top-p, for a whole batch.

Every row is filtered and sampled with batched tensor operations and the batch's tokens reach the host
in one copy, so a step of sampled requests costs a few kernels, not a few per row. A row draws its
randomness from its request's own generator (exponential noise over the vocabulary, then the
"exponential race": argmax of p / E is a draw from p), so its tokens depend only on its seed, never on
what else is in the batch.
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
    """logits: [B, V] float32 -> one token id per row."""
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy.tolist()
    probs = filtered_probs(logits, params)  # [B, V]
    noise = torch.stack([torch.empty_like(logits[0]).exponential_(generator=g) if g is not None else
                         torch.ones_like(logits[0]) for g in generators])
    drawn = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    return torch.where(is_greedy, greedy, drawn).tolist()


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[B, V] probabilities after temperature, top-k and top-p (greedy rows: any valid distribution)."""
    B, V = logits.shape
    dev = logits.device
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
    x = logits / temps[:, None]
    ks = [p.top_k if 0 < p.top_k < V else V for p in params]
    if min(ks) < V:
        top = torch.topk(x, max(k for k in ks if k < V), dim=-1).values  # [B, kmax], descending
        kth = top.gather(1, torch.tensor([min(k, top.shape[1]) - 1 for k in ks], device=dev)[:, None])
        kth = torch.where(torch.tensor([k < V for k in ks], device=dev)[:, None], kth, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    if (top_p < 1.0).any():
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest set whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p[:, None]
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def pick_tokens(batch, logits: torch.Tensor, generator_for) -> list[int | None]:
    """A token for each (sequence, new tokens) row whose prompt this step finishes (None elsewhere)."""
    return sampling_np.pick_tokens(batch, logits, generator_for, sample)
