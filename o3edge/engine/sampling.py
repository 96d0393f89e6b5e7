"""Choosing the next token from logits: greedy, or temperature with top-k and top-p."""

from __future__ import annotations

import torch

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
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, (p, gen) in enumerate(zip(params, generators)):
        out.append(greedy[row] if p.greedy else _sample_row(logits[row], p, gen))
    return out


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    # logits: [V]
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest set whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen).item())
