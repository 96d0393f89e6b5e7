"""Where a configured model lives: a given directory, or the built-in default."""

from __future__ import annotations

import os

from o3edge.errors import CheckpointError

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")
# the reference model trained by tools/train_reference.py and shipped with the package (bf16 checkpoint,
# 1,024-token window): the model quality figures and exactness tests are measured on
SHIPPED_MODEL = os.path.join(MODELS, "o3edge-ref")
# the built-in default: the long-context reference model (train_reference.py --shape long, 4,096-token
# window, answers chat questions about the docs), shipped as an INT4-FFN engine directory
DEFAULT_MODEL = os.path.join(MODELS, "o3edge-ref-long-int4")


def default_model_path() -> str:
    """The shipped default model; the first reference model, then the random tiny model, when this
    install lacks it."""
    for path in (DEFAULT_MODEL, SHIPPED_MODEL):
        if os.path.exists(os.path.join(path, "model.safetensors")):
            return path
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
