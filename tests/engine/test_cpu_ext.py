"""o3edge's own CPU kernels (cpu_ext.py): the VNNI INT8/INT4 linears against their dequantized weights (also as
built for an AVX-VNNI CPU without AVX-512), the C++ span attention against the Python one (also as built for an
AVX2-only CPU), the choice of instruction set, and the fallback to torch's kernels."""

import platform

import pytest
import torch

from o3edge.engine import cpu_ext, cpu_features, cpu_quant, native_lib
from o3edge.engine.cpu_compiled import span_decode_attention
from o3edge.engine.cpu_quant import Int8Linear, dequantize_int8, quantize_int8
from o3edge.engine.quant import Int4Linear, dequantize_int4, quantize_int4

needs_kernels = pytest.mark.skipif(not cpu_ext.available(),
                                   reason="this CPU lacks AVX-512 VNNI and AVX-VNNI (or no g++/ninja)")


def narrow_isas():
    """The AVX-VNNI and AVX2 builds as test parameters, each skipped on a CPU that lacks what it needs (or where the
    row kernels are switched off)."""
    params = []
    for isa in ("avxvnni", "avx2"):
        missing = cpu_features.ROW_KERNEL_NEEDS[isa] - cpu_features.cpu_flags()
        params.append(pytest.param(isa, marks=pytest.mark.skipif(
            bool(missing) or cpu_features.row_kernel_isa() is None,
            reason=f"this CPU lacks {', '.join(sorted(missing))} (or the row kernels are switched off)")))
    return params


needs_attention = pytest.mark.skipif(not cpu_ext.attention_available(), reason="this CPU lacks AVX2 (or no g++/ninja)")


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 130])
@pytest.mark.parametrize("k", [80, 576])
def test_vnni_int8_linear_matches_its_dequantized_weight(rows, k):
    w = torch.randn(48, k)
    q, scales = quantize_int8(w)
    layer = Int8Linear(k, 48)
    assert layer.kernel == "vnni"
    layer.load_quantized(q, scales)
    x = torch.randn(2, rows, k)
    ref = x @ dequantize_int8(q, scales).T
    out = layer(x)
    assert out.shape == (2, rows, 48) and out.dtype == torch.float32
    assert (out - ref).norm() / ref.norm() < 1.5e-2  # int8 activations per group of columns


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 130])
@pytest.mark.parametrize("k,group", [(80, 32), (576, 64), (1536, 32)])
def test_vnni_int4_linear_matches_its_dequantized_weight(rows, k, group):
    """K not a multiple of the group (80 -> 96 zero-padded columns) included."""
    w = torch.randn(64, k)
    qweight, sz = quantize_int4(w, group)
    layer = Int4Linear(k, 64, group)
    layer.load_quantized(qweight, sz)
    assert layer.vnni
    x = torch.randn(rows, k)
    ref = x @ dequantize_int4(qweight, sz, k).T
    out = layer(x)
    assert out.shape == (rows, 64) and out.dtype == torch.float32
    assert (out - ref).norm() / ref.norm() < 1.5e-2


@needs_attention
@pytest.mark.parametrize("dtype,pool", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                        (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
def test_span_attention_writes_and_attends_like_the_python_op(dtype, pool):
    """Three sequences at different positions in one pool (float32, or bfloat16 / float16 as an engine of that dtype
    keeps it): the same cache writes, bit for bit, and the same outputs."""
    torch.manual_seed(0)
    L, S, KVH, H, hd = 2, 96, 2, 6, 64
    kv = torch.randn(L, 2, S, KVH, hd).to(pool)
    q, k, v = (torch.randn(3, n, hd).to(dtype) for n in (H, KVH, KVH))
    positions = torch.tensor([0, 17, 40])
    slots = torch.tensor([3, 20 + 17, 50 + 40])
    ours, ref = kv.clone(), kv.clone()
    out = torch.ops.o3edge_cpu.span_attention(q, k, v, ours, 1, slots, positions)
    expected = span_decode_attention(*(t.to(pool) for t in (q, k, v)), ref, 1, slots, positions)
    assert torch.equal(ours, ref)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)


@needs_kernels
def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_start():
    """A process killed while it built the kernels leaves torch's lock file in the build directory; the next
    process (a real one, on the same cache) still loads them instead of waiting on that file for ever."""
    import subprocess
    import sys

    lock = cpu_ext.build_dir() / "lock"
    lock.touch()  # what a builder killed mid-build leaves
    try:
        out = subprocess.run([sys.executable, "-c", "from o3edge.engine import cpu_ext; print(cpu_ext.available())"],
                             capture_output=True, text=True, timeout=120)
    finally:
        lock.unlink(missing_ok=True)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def test_kernels_off_keeps_torchs_kernels(monkeypatch):
    """O3EDGE_CPU_KERNELS=torch (or a CPU without VNNI): INT8 layers take fbgemm, INT4 layers int4pack."""
    monkeypatch.setenv("O3EDGE_CPU_KERNELS", "torch")
    cpu_ext.available.cache_clear()
    try:
        assert not cpu_ext.available()
        assert Int8Linear(64, 48).kernel == ("fbgemm" if cpu_quant.has_fbgemm() else "int8pack")
        layer = Int4Linear(64, 32, 32)
        layer.load_quantized(*quantize_int4(torch.randn(32, 64), 32))
        assert not layer.vnni
    finally:
        monkeypatch.delenv("O3EDGE_CPU_KERNELS")
        cpu_ext.available.cache_clear()


def test_layers_the_kernel_cannot_take_fall_back():
    """Rows not a multiple of 16: fbgemm (or int8pack), whatever the CPU."""
    assert Int8Linear(64, 40).kernel in ("fbgemm", "int8pack")


@needs_kernels
def test_loading_twice_in_one_process_is_harmless():
    cpu_ext.available.cache_clear()
    assert cpu_ext.available() and cpu_ext.available()


@pytest.mark.skipif(not cpu_ext.ISA_NEEDS["avx2"] <= cpu_features.cpu_flags() or cpu_ext.attention_isa() is None,
                    reason="this CPU lacks AVX2 and FMA (or the C++ attention is switched off)")
def test_the_attention_built_for_an_avx2_cpu_attends_like_torch():
    """O3EDGE_CPU_ATTN_ISA=avx2 (a real process): the decode attention built for Haswell's instructions, as an
    AVX2-only machine builds it (8-float vectors), passes the span attention's and the router's C++ tests against
    torch's operations, none of them skipped."""
    probe, run = _tests_in_a_process(
        "O3EDGE_CPU_ATTN_ISA", "avx2", "cpu_ext.attention_isa(), cpu_ext.attention_available()",
        ["tests/engine/test_cpu_ext.py::test_span_attention_writes_and_attends_like_the_python_op",
         "tests/engine/test_router.py::test_decoding_queries_over_both_pools_in_cpu_kernels_match_torch"])
    assert probe == ["avx2", "True"], run.stdout[-1000:] + run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-3000:]
    assert "14 passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-1000:]


def _tests_in_a_process(var: str, value: str, probe: str, tests: list[str]):
    """With var=value, in a process of its own: print the Python expression probe (over cpu_ext and cpu_features),
    then run tests under pytest; (probe's words, the finished process)."""
    import os
    import subprocess
    import sys

    script = ("import sys, pytest; from o3edge.engine import cpu_ext, cpu_features; "
              f"print({probe}, flush=True); sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *{tests!r}]))")
    run = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, **{var: value}), capture_output=True,
                         text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    return run.stdout.split("\n")[0].split(), run


@pytest.mark.parametrize("value", ["off", "sse9", "avx1024"])
def test_an_attention_width_switched_off_or_unknown_keeps_torchs_operations(value, monkeypatch, caplog):
    """O3EDGE_CPU_ATTN_ISA=off, or a width o3edge does not build (or this CPU lacks): no library is built for it, the
    engines keep torch's operations, and an unknown value is named in a warning."""
    monkeypatch.setenv("O3EDGE_CPU_ATTN_ISA", value)
    with caplog.at_level("WARNING", logger="o3edge.engine.cpu_ext"):
        assert cpu_ext.attention_isa() is None
    assert (value in caplog.text) == (value != "off")


@pytest.mark.parametrize("isa", narrow_isas())
def test_the_row_kernels_built_for_a_cpu_without_avx512_match_their_dequantized_weights(isa):
    """O3EDGE_CPU_ISA=avxvnni|avx2 (a real process): the INT8 and INT4 linears built for AVX-VNNI (256-bit vpdpbusd,
    Alder Lake's instructions) and for AVX2 (no VNNI: the byte products by vpmaddubsw and vpmaddwd, Haswell's
    instructions), as a CPU without AVX-512 builds them, pass the tests above, none of them skipped."""
    probe, run = _tests_in_a_process(
        "O3EDGE_CPU_ISA", isa, "cpu_features.row_kernel_isa(), cpu_ext.available()",
        ["tests/engine/test_cpu_ext.py::test_vnni_int8_linear_matches_its_dequantized_weight",
         "tests/engine/test_cpu_ext.py::test_vnni_int4_linear_matches_its_dequantized_weight"])
    assert probe == [isa, "True"], run.stdout[-1000:] + run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-3000:]
    assert "15 passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-1000:]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="not x86-64: no row kernels to choose")
@pytest.mark.parametrize("value", ["sse9", "avx1024", "avx2", "avxvnni", "avx512"])
def test_the_row_kernel_isa_is_the_widest_this_cpu_has_or_the_one_asked_for(value, monkeypatch, caplog):
    """Unset: AVX-512 VNNI where the CPU has it, else AVX-VNNI, else AVX2, else none. O3EDGE_CPU_ISA=avx512|avxvnni|avx2: that one
    where the CPU has it; a value o3edge does not know, or one this CPU lacks: none (torch's kernels) and a warning
    naming it."""
    have = cpu_features.cpu_flags()
    runs = [isa for isa, needs in cpu_features.ROW_KERNEL_NEEDS.items() if needs <= have]
    monkeypatch.delenv("O3EDGE_CPU_KERNELS", raising=False)
    monkeypatch.delenv("O3EDGE_CPU_ISA", raising=False)
    assert cpu_features.row_kernel_isa() == (runs[0] if runs else None)
    monkeypatch.setenv("O3EDGE_CPU_ISA", value)
    with caplog.at_level("WARNING", logger="o3edge.engine.cpu_features"):
        isa = cpu_features.row_kernel_isa()
    if value in runs:
        assert isa == value and cpu_features.why_no_vnni_kernels() is None and not caplog.text
    else:
        assert isa is None and value in caplog.text
        assert cpu_features.why_no_vnni_kernels() == f"O3EDGE_CPU_ISA={value} (unknown, or this CPU lacks it)"
    monkeypatch.setenv("O3EDGE_CPU_KERNELS", "torch")
    assert cpu_features.row_kernel_isa() is None


def test_each_row_kernel_isa_builds_in_a_directory_of_its_own():
    """One cache entry per instruction set, for the torch library and the torch-free one: switching O3EDGE_CPU_ISA
    never loads another's build; the AVX-VNNI one is compiled for Alder Lake's instructions and the AVX2 one for
    Haswell's, not for this machine."""
    isas = list(cpu_features.ROW_KERNEL_NEEDS)
    assert len({cpu_ext.build_dir(flags=cpu_ext.row_flags(isa)) for isa in isas}) == len(isas)
    assert len({native_lib.build_path(isa) for isa in isas}) == len(isas)
    for flags in (cpu_ext.row_flags("avxvnni"), native_lib.build_flags("avxvnni")):
        assert "-march=native" not in flags and {"-mavxvnni", "-DO3_AVXVNNI"} <= set(flags)
    for flags in (cpu_ext.row_flags("avx2"), native_lib.build_flags("avx2")):
        assert "-march=native" not in flags and "-mavxvnni" not in flags and {"-mavx2", "-DO3_AVX2"} <= set(flags)
