"""Where a daemon started by hand (not the system service) keeps its files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/o3edge, else ~/.cache/o3edge: built kernels and compiled code, safe to delete."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "o3edge"


def user_state_dir(env: Mapping[str, str] | None = None) -> Path:
    """$XDG_STATE_HOME/o3edge, else ~/.local/state/o3edge (the XDG base-directory default)."""
    env = os.environ if env is None else env
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "o3edge"
