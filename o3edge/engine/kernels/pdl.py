"""Programmatic dependent launch (Hopper and later): a kernel starts while the one before it finishes.

A decode step is ~120 short dependent kernels; without help each one waits for the previous one to
drain completely, then pays its own launch and its first round trip to memory before any byte streams.
With PDL, each kernel of the step is launched with CUDA's programmatic stream serialization and:
- tells the GPU at once that the next kernel may launch (`launch_next`): the next kernel's programs
  take the SM slots the tail of this one frees;
- does what does not depend on the previous kernel first (reading step metadata);
- waits (`wait_for_previous`) for the previous kernel to complete, its writes visible, before it reads
  what that kernel wrote and before it writes anything.
Every kernel launched this way waits before its first dependent read and its first write, so kernel
n+2 reading kernel n's output is safe too (n+1 could not finish before n did). Kernels launched
without the attribute (torch's, cuBLAS) keep the ordinary full dependency.

Off where it cannot work: under Triton's interpreter, before compute capability 9.0, or with
`O3EDGE_PDL=0` (to measure against). On the H200 it took a batch-1 step of `llama-1b` from 1.012 to
0.965 ms and of `tinyllama-1.1b` from 0.970 to 0.885 ms (docs/results/gpu-2026-11-30b/). Pulling a
skinny matmul's weights into L2 before the wait was tried there and dropped: its first tile changed a
step by -1% to +4%, its whole slice cost 12-20% (evicted before it was read).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from o3edge.engine.kernels import INTERPRET


@functools.lru_cache(maxsize=None)
def enabled(device: str) -> bool:
    """Whether kernels on this device launch with PDL."""
    dev = torch.device(device)
    if dev.type != "cuda" or INTERPRET or os.environ.get("O3EDGE_PDL") == "0":
        return False
    return torch.cuda.get_device_capability(dev)[0] >= 9


def reload() -> None:
    """Read O3EDGE_PDL again (kernels captured before keep their setting)."""
    enabled.cache_clear()


def launch_options(pdl: bool) -> dict:
    """Extra launch arguments of a kernel that takes PDL as a constexpr."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Let the next kernel in the stream launch now (it waits before it reads what this one writes)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Block until the previous kernel has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
