"""Rotary position embedding tables, with Llama-3 and linear scaling, built once."""

from __future__ import annotations

import math

import torch

from o3edge.engine.checkpoint import ModelArgs


def inverse_frequencies(args: ModelArgs) -> torch.Tensor:
    """inv_freq [head_dim/2] in float32, scaled as the checkpoint asks (matches transformers)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    return _llama3(inv_freq, scaling)


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama-3.1 frequency-dependent scaling: long wavelengths slowed, short kept, smooth between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(args: ModelArgs, max_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, head_dim], computed in float32 then cast, as transformers does."""
    inv_freq = inverse_frequencies(args)
    pos = torch.arange(max_len, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq)  # [max_len, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, head_dim] (rotate-half convention)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
