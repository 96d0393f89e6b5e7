"""Where a configured model lives: a given directory, or the built-in default."""

from __future__ import annotations

import os

from o3edge.errors import CheckpointError

# the reference model trained by tools/train_reference.py and shipped with the package
SHIPPED_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "o3edge-ref")


def default_model_path() -> str:
    """The shipped reference model; the random tiny model when this install lacks it."""
    if os.path.exists(os.path.join(SHIPPED_MODEL, "model.safetensors")):
        return SHIPPED_MODEL
    from o3edge.tiny import default_tiny_path

    return default_tiny_path()


def resolve_model_path(model_path: str | None) -> str:
    """The model directory to load; None means the built-in default model."""
    if model_path is None or model_path == "":
        return default_model_path()
    path = os.path.expanduser(model_path)
    if not os.path.isdir(path):
        raise CheckpointError(f"model path {path} is not a directory")
    return path
