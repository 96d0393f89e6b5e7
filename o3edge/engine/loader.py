"""Turning checkpoint tensors into a ready Transformer on the chosen device and dtype."""

from __future__ import annotations

import torch

from o3edge.engine.checkpoint import ModelArgs, load_tensors, read_model_args
from o3edge.engine.model import Transformer, hf_weight_map
from o3edge.errors import CheckpointError


def build_state_dict(args: ModelArgs, tensors: dict, dtype: torch.dtype) -> dict:
    """Our state dict from Hugging Face tensors: fused q/k/v and gate/up, cast to dtype."""
    state = {}
    for ours, theirs in hf_weight_map(args).items():
        missing = [n for n in theirs if n not in tensors]
        if missing:
            raise CheckpointError(f"checkpoint lacks tensor(s) {missing}")
        parts = [tensors[n] for n in theirs]
        state[ours] = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)).to(dtype)
    return state


def check_shapes(model: Transformer, state: dict) -> None:
    """Refuse tensors whose shapes disagree with config.json, naming the first offender."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    for name, shape in expected.items():
        if name not in state:
            raise CheckpointError(f"no weight for {name}")
        if tuple(state[name].shape) != tuple(shape):
            raise CheckpointError(
                f"weight {name} has shape {tuple(state[name].shape)}, config.json implies {tuple(shape)}")


def load_model(model_dir: str, device: torch.device, dtype: torch.dtype) -> tuple[Transformer, ModelArgs]:
    """Read a Hugging Face checkpoint directory into an eval-mode Transformer."""
    args = read_model_args(model_dir)
    with torch.device("meta"):
        model = Transformer(args)
    state = build_state_dict(args, load_tensors(model_dir), dtype)
    check_shapes(model, state)
    model.load_state_dict(state, assign=True)
    return model.to(device).eval().requires_grad_(False), args
