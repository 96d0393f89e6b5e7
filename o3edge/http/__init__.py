"""The HTTP door (an OpenAI-compatible endpoint) and overflow to an upstream OpenAI-compatible engine.

Both are off by default ([http] enabled, [upstream] url); docs/http.md describes them for users.
Nothing here is imported unless one of them is on, except the settings' dataclasses (config.py).
"""
