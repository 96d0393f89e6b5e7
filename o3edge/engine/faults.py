"""Which errors of a step leave the engine able to serve, and which end it.

A step's error that names no device failure ends only the requests of that step (their KV blocks are
freed, what the step wrote is never marked computed). A lost or poisoned device does not recover: CUDA
errors are sticky, every later call fails the same way, so the engine reports EngineFailed and
systemd restarts the daemon. Out of memory is recoverable once (the cache allocator frees what it
holds); MAX_FAILED_STEPS failing steps in a row are not.

torch is looked up, not imported: a process that never loaded it (the native backend) has no torch errors.
"""

from __future__ import annotations

import sys

MAX_FAILED_STEPS = 3  # consecutive failing steps (out of memory, or any other error) before the engine gives up
DEVICE_LOST = ("CUDA error", "device-side assert", "illegal memory access", "unspecified launch failure",
               "CUBLAS_STATUS", "cuDNN error", "device not ready", "ECC error")


def is_fatal(exc: BaseException) -> bool:
    """True when the device is gone or poisoned: no later step can succeed."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    if torch is not None and isinstance(exc, torch.AcceleratorError):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in DEVICE_LOST)


def recover(exc: BaseException) -> None:
    """Give back what a failed step left allocated (out of memory: the allocator's free blocks)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError) and torch.cuda.is_available():
        torch.cuda.empty_cache()
