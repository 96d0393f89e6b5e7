"""Triton kernels for the CUDA decode step.

The kernel modules are imported only on CUDA (and by the kernel tests, which run them on CPU tensors
under `TRITON_INTERPRET=1`), so a CPU-only install never needs Triton; this package file itself needs
only torch. Each file holds one kernel family
with a plain-torch reference beside it; the GPU tests hold the kernels to those references.
"""

import functools
import os

import torch

# Triton's interpreter runs the kernels (CPU tests): no PTX-only features, no tensor as a range bound
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def num_sms(device: str) -> int:
    """Streaming multiprocessors of a CUDA device (work is split to fill them); 4 elsewhere (tests)."""
    dev = torch.device(device)
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4


def cuda_index(device: torch.device) -> int | None:
    """device's index on CUDA (None elsewhere), for torch.cuda.current_stream(index): torch's Event.record() without
    a stream looks the current device up through ~10 Python calls (is_available, an environment read...), ~6% of a
    small model's host step on the H200's host where a step recorded one that way (py-spy, docs/benchmarks.md,
    the fourteenth session)."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()
