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
