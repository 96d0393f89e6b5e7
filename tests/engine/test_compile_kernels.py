"""The CUDA step's kernels compile for Hopper here, without a GPU (tools/compile_kernels.py), and the
ones launched with programmatic dependent launch keep its one rule in the generated code: no global
write before `griddepcontrol.wait`, so a kernel that starts early never clobbers what the previous one
still reads, nor publishes a value computed from its unfinished output. They also compile, without
programmatic dependent launch (Hopper's; pdl.py turns it off below), for the edge and desktop GPUs a user
would run o3edged on (a Jetson Orin, sm_87; an RTX 30 card, sm_86), within those GPUs' shared memory a
block."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import require_triton

require_triton()

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import json, sys
from tools.compile_kernels import compile_all
out = [(name, pdl, k.asm["ptx"]) for name, pdl, k in compile_all(pdl=True)]
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    env["PYTHONPATH"] = ROOT
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    return json.loads(run.stdout)


def _body(ptx: str) -> list[str]:
    """PTX instructions, without their predicate guards (`@%p3 st.global.b16 ...` -> `st.global.b16 ...`)."""
    return [re.sub(r"^@!?%p\d+\s+", "", line.strip()) for line in ptx.splitlines()]


def test_every_step_kernel_compiles_for_hopper(compiled):
    names = {name for name, _, _ in compiled}
    assert {"_skinny_kernel", "_decode_attention_kernel", "_merge_splits_kernel",
            "_chunk_argmax_kernel", "_pick_chunk_kernel", "_add_rmsnorm_kernel", "_silu_mul_kernel",
            "_dequantize_kernel"} <= names


def test_pdl_kernels_write_nothing_before_they_wait(compiled):
    checked = 0
    for name, pdl, ptx in compiled:
        if not pdl:
            continue
        lines = _body(ptx)
        wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait"))
        trigger = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.launch_dependents"))
        writes = [i for i, line in enumerate(lines) if line.startswith(("st.global", "atom.global", "red.global"))]
        assert writes and min(writes) > wait, name
        assert trigger < wait, name
        checked += 1
    assert checked >= 13


EDGE = """
import json, sys
from tools.compile_kernels import compile_all
json.dump({arch: [(name, k.metadata.shared) for name, _, k in compile_all(pdl=False, arch=arch)] for arch in (86, 87)},
          sys.stdout)
"""

# the most shared memory a block may opt in to (CUDA programming guide, compute capabilities table): 99 KiB on
# sm_86 / sm_89 (RTX 30 / 40), 163 KiB on sm_80 / sm_87 (A100, Jetson Orin)
SHARED_LIMIT = {86: 99 * 1024, 87: 163 * 1024}


def test_every_step_kernel_compiles_for_jetson_orin_and_rtx_30_within_their_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    run = subprocess.run([sys.executable, "-c", EDGE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    by_arch = json.loads(run.stdout)
    for arch, kernels in by_arch.items():
        names = {name for name, _ in kernels}
        assert {"_skinny_kernel", "_row_stream_kernel", "_decode_attention_kernel", "_router_decode_kernel",
                "_merge_splits_kernel", "_chunk_argmax_kernel", "_add_rmsnorm_kernel", "_embed_rows_kernel",
                "_dequantize_kernel"} <= names, arch
        too_big = [(name, shared) for name, shared in kernels if shared > SHARED_LIMIT[int(arch)]]
        assert not too_big, (arch, too_big)
