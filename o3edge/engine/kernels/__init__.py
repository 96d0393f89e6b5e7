"""Triton kernels for the CUDA decode step.

Imported only on CUDA (and by the kernel tests, which run them on CPU tensors under
`TRITON_INTERPRET=1`), so a CPU-only install never needs Triton. Each file holds one kernel family
with a plain-torch reference beside it; the GPU tests hold the kernels to those references.
"""
