"""o3edge: an on-device LLM inference daemon and its in-process API.

The API names load lazily, so the client, the CLI and the power package start without torch.
"""

__all__ = ["O3Config", "O3Model", "GenerationResult"]
__version__ = "0.1.0"


def __getattr__(name):
    if name in ("O3Model", "GenerationResult"):
        from o3edge import api

        return getattr(api, name)
    if name == "O3Config":
        from o3edge.config import O3Config

        return O3Config
    raise AttributeError(f"module 'o3edge' has no attribute {name!r}")
