"""Small helpers shared by tests in several folders."""

import time


def wait_for(predicate, timeout=5.0, interval=0.02):
    """Poll until predicate() is truthy; returns its last value."""
    end = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < end:
        time.sleep(interval)
        value = predicate()
    return value


def require(name: str):
    """Import a package of the `test` extra (transformers, onnx, onnxruntime, triton): its absence fails
    the run (a collection error) instead of skipping the tests that need it, so CI cannot go green
    without the exactness checks."""
    import importlib

    import pytest

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.fail(f"{name} is not installed ({exc}); it is in the `test` extra: pip install -e '.[test]'",
                    pytrace=False)
