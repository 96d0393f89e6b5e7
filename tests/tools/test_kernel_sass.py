"""tools/kernel_sass.py: o3edge's Triton kernels compiled for the H200 (sm_90) on a machine without a GPU,
and what the packed INT4 tile changes in them."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import require_triton

require_triton()

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sass(*args, kernel="_skinny_kernel"):
    """(registers, bytes spilled, the tool's report) of `kernel` as tools/kernel_sass.py compiles it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "kernel_sass.py"), *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(rf"\b{kernel}: (\d+) registers, (\d+) bytes spilled, \d+ B shared, (\d+) instructions", out.stdout)
    assert m, out.stdout
    return int(m.group(1)), int(m.group(2)), out.stdout


@pytest.mark.parametrize("asm", ["0", "1"])
def test_int4_tile_compiles_for_sm90_without_spilling(asm):
    # tinyllama gate/up, one program a 32-output slice over all of K (eight splits, as planned, leave each
    # program one tile: nothing to pipeline)
    regs, spilled, text = _sass("gemv", "--rows", "8", "--config", "32,256,1,4", "--env", f"O3EDGE_INT4_ASM={asm}")
    assert 0 < regs <= 255 and spilled == 0
    assert "cp.async" in text  # the weight tiles' loads are software-pipelined
    packed = re.search(r"HFMA2 (\d+)", text)  # the word path scales eight halves with packed FMAs
    assert bool(packed) == (asm == "1"), text


@pytest.mark.parametrize("rows", ["2", "8"])
def test_int4_tile_register_cap_fits_four_programs_an_sm(rows):
    """An INT4 LM head's tile of 2-8 rows (tinyllama's 32,000 outputs: 1,000 programs, more than a wave at
    three an SM) is capped at 128 registers a thread (four programs of four warps an SM, as the 16-row tile
    Triton specializes), without spilling; without the cap (O3EDGE_INT4_MAXNREG=0) it takes more. The same
    tiling over tinyllama's gate/up (352 programs, one wave either way) is left alone."""
    tiles = ("--dtype", "bfloat16", "--env", "O3EDGE_INT4_ROWS=0")  # the tiles, not two rows streamed (rows_int4)
    shape = ("gemv", "--rows", rows, "--n", "32000", "--k", "2048", *tiles)
    capped, spilled, _ = _sass(*shape)
    free, _, _ = _sass(*shape, "--env", "O3EDGE_INT4_MAXNREG=0")
    assert capped <= 128 and spilled == 0 and free > 128
    assert _sass("gemv", "--rows", rows, "--config", "32,256,1,4", *tiles)[0] > 128


def test_int4_register_cap_can_be_set_for_any_tile_to_measure():
    """O3EDGE_INT4_MAXNREG=R caps every INT4 tile of several rows at R registers (the 32-row swapped tile
    takes more than 200 uncapped), the measurement behind benchmarks.md's 32-row note."""
    shape = ("gemv", "--rows", "32", "--n", "11264", "--k", "2048", "--config", "64,256,2,4")
    assert _sass(*shape)[0] > 200
    assert _sass(*shape, "--env", "O3EDGE_INT4_MAXNREG=168")[0] <= 168


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_streamed_int4_rows_compile_for_sm90_without_spilling(dtype):
    """Two rows of llama-1b's INT4 gate/up, as planned (rows_int4): streamed without the tensor cores, each
    tile dequantized to half pairs once and multiplied row by row on packed multiply-adds."""
    regs, spilled, text = _sass("gemv", "--rows", "2", "--n", "16384", "--k", "2048", "--dtype", dtype,
                                kernel="_rows_stream_kernel")
    assert regs <= 255 and spilled == 0, text
    assert re.search(r"HFMA2 \d+", text), text


@pytest.mark.parametrize("kernel", ["_observe_kernel", "_cover_kernel"])
def test_the_route_kernels_compile_for_sm90_without_spilling(kernel):
    """kernels/route.py's two kernels at the built-in long model's routing (16 rows, 4,096 positions in blocks
    of 32, 2 KV heads), which no GPU has run yet: they compile for sm_90 (float64 sums and scans, a bool
    store, barriers inside a program), and nothing spills."""
    regs, spilled, _ = _sass("route", "--shape", "ref-long", "--batch", "16", "--context", "4096", kernel=kernel)
    assert 0 < regs <= 255 and spilled == 0
