"""Small helpers shared by tests in several folders."""

import time

import torch

from o3edge.engine.cpu_features import cpu_bf16

# Triton kernels run compiled on CUDA, and on CPU tensors under Triton's interpreter (tests/conftest.py),
# which has no bfloat16 dot
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_DTYPES = ([torch.float32, torch.float16, torch.bfloat16] if KERNEL_DEVICE == "cuda"
                 else [torch.float32, torch.float16])
# what dtype "auto" runs a bfloat16 engine in on this machine's CPU: bfloat16 where the CPU multiplies it
# natively (AVX512-BF16 or AMX), float32 where bf16 products would be emulated (engine.resolve_dtype)
AUTO_CPU_DTYPE = "bfloat16" if cpu_bf16() else "float32"


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


def require_triton():
    """Triton is in the `test` extra where it installs (Linux): missing there, the kernel tests fail;
    elsewhere they skip."""
    import sys

    import pytest

    return require("triton") if sys.platform == "linux" else pytest.importorskip("triton")


def act_quantized(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """x [M, K] as one streamed row of INT8 or INT4 weights sees it on dp4a (kernels/gemv.py): per group of 32
    columns, codes round(x * 127 / max|x|) (ties to even) times max|x| / 127, in float32 (the CPU's INT8 kernels
    quantize alike: cpu_kernels.h)."""
    xg = x.float().view(x.shape[0], -1, group)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(xg * inv) * (amax / 127)).view(x.shape)
