"""o3edge: an on-device LLM inference daemon and its in-process API."""

from o3edge.api import GenerationResult, O3Model
from o3edge.config import O3Config

__all__ = ["O3Config", "O3Model", "GenerationResult"]
__version__ = "0.1.0"
