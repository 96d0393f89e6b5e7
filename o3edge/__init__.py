"""o3edge: an on-device LLM inference daemon and its in-process API.

The API names load lazily, so the client, the CLI and the power package start without torch.
"""

import warnings


# torch warns "Failed to initialize NumPy" on import wherever numpy is missing (a fresh install):
# o3edge never uses numpy, so the warning is noise on every start.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

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
