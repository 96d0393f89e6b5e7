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
