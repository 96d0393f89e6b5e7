"""Where a configured model lives: a given directory, or the built-in default."""

from __future__ import annotations

import os

from o3edge.errors import CheckpointError


def resolve_model_path(model_path: str | None) -> str:
    """The model directory to load; None means the built-in default model."""
    if model_path is None or model_path == "":
        from o3edge.tiny import default_tiny_path

        return default_tiny_path()
    path = os.path.expanduser(model_path)
    if not os.path.isdir(path):
        raise CheckpointError(f"model path {path} is not a directory")
    return path
