"""The decode step's skinny matmuls (kernels/gemv.py) against plain torch: prologue, then F.linear.

Under TRITON_INTERPRET=1 on CPU tensors in CI; compiled on a CUDA machine when run there without the
`-m gpu` filter; the `gpu`-marked test at the end holds the decode step's own tilings (streamed one-row
matmuls, the packed INT4 dot) at real model shapes to the reference on the GPU (`pytest -m gpu`)."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import KERNEL_DEVICE, KERNEL_DTYPES, act_quantized, require_triton

triton = require_triton()

from o3edge.engine.kernels.activation import silu_mul_reference  # noqa: E402
from o3edge.engine.kernels.gemv import skinny_matmul  # noqa: E402
from o3edge.engine.kernels.norm import add_rmsnorm_reference  # noqa: E402
from o3edge.engine.quant import dequantize_int4, quantize_int4  # noqa: E402

CUDA = KERNEL_DEVICE == "cuda"
DEV, DTYPES = KERNEL_DEVICE, KERNEL_DTYPES
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _data(M, N, K, dtype, seed, x_cols=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, x_cols or K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV, dtype)
    return g, x, w


def _close(out, ref, dtype):
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("N,K", [(40, 96), (64, 1000), (136, 2048)])
# planned, split-K, and streamed (one row: sums deferred to the row block, or per tile)
@pytest.mark.parametrize("config", [None, (8, 64, 4, 4), (8, 64, 1, 4, 1), (16, 512, 1, 1, 1)])
def test_plain_matches_linear(dtype, M, N, K, config):
    g, x, w = _data(M, N, K, dtype, N + K)
    bias = torch.randn(N, generator=g).to(DEV, dtype)
    cfg = None if config is None else ((16 if M > 1 else 8),) + config[1:]
    _close(skinny_matmul(x, w, bias=bias, config=cfg), F.linear(x.float(), w.float(), bias.float()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("config", [(16, 128, 2, 4), (8, 128, 1, 4, 1)])  # one row also streamed
def test_norm_prologue_matches_add_rmsnorm_then_linear(dtype, M, with_residual, config):
    N, K = 72, 576
    g, x, w = _data(M, N, K, dtype, M)
    res = torch.randn(M, K, generator=g).to(DEV, dtype) if with_residual else None
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(DEV, dtype)
    res_before = None if res is None else res.clone()
    out, new_res = skinny_matmul(x, w, norm_weight=nw, residual=res, eps=1e-5, config=config)
    res_ref = None if res is None else res.clone()
    ref = F.linear(add_rmsnorm_reference(x, res_ref, nw, 1e-5).float(), w.float())
    _close(out, ref, dtype)
    if with_residual:  # the new residual is exactly the eager add, and the old one is left alone
        torch.testing.assert_close(new_res, res_ref, atol=0, rtol=0)
        torch.testing.assert_close(res, res_before, atol=0, rtol=0)
    else:
        assert new_res is x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("config", [None, (4, 128, 1, 4, 1)])  # planned, and (one row) streamed
def test_silu_prologue_matches_silu_mul_then_linear(dtype, M, config):
    N, K = 48, 344  # an intermediate size that is no multiple of the tile
    g, gu, w = _data(M, N, K, dtype, K, x_cols=2 * K)
    ref = F.linear(silu_mul_reference(gu).float(), w.float())
    _close(skinny_matmul(gu, w, silu=True, config=config), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16] if CUDA else [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 8, 33])
@pytest.mark.parametrize("K,group", [(256, 64), (320, 64), (512, 128)])
@pytest.mark.parametrize("swap", ["0", "1"])  # tiles of several rows as x @ W.T, or W @ x.T
@pytest.mark.parametrize("asm", ["0", "1"])  # tiles of several rows dequantized a word at a time, or a nibble
def test_int4_weights_match_the_dequantized_linear(dtype, M, K, group, swap, asm, monkeypatch):
    monkeypatch.setenv("O3EDGE_INT4_SWAP", swap)
    monkeypatch.setenv("O3EDGE_INT4_ASM", asm)
    N = 48
    g, x, w = _data(M, N, K, dtype, K + group)
    qw, sz = quantize_int4(w.float().cpu(), group)
    act = act_quantized(x) if M == 1 else x.float()  # one row streams on dp4a (dp4a_int4)
    ref = F.linear(act, dequantize_int4(qw, sz, K).to(dtype).float().to(DEV))
    out = skinny_matmul(x, qw.to(DEV), scales_and_zeros=sz.to(DEV), group_size=group, out_features=N)
    _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16] if CUDA else [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [3, 8, 32])
@pytest.mark.parametrize("int4", [False, True])
@pytest.mark.parametrize("config", [None, (16, 128, 2, 4)])  # planned, and K split (the last split's epilogue)
def test_silu_in_the_epilogue_equals_the_projection_then_silu_mul(dtype, M, int4, config, monkeypatch):
    """A fused gate/up projection whose tiles end in SiLU(gate) * up gives what the projection and the
    SiLU·mul kernel give one after the other, the rounding of each included; an intermediate size that is no
    multiple of the half tile, swapped and unswapped tiles (32 rows swap)."""
    I, K, group = 44, 256, 64
    g, x, w = _data(M, 2 * I, K, dtype, M + I)
    kw = {}
    if int4:
        qw, sz = quantize_int4(w.float().cpu(), group)
        w, kw = qw.to(DEV), dict(scales_and_zeros=sz.to(DEV), group_size=group, out_features=2 * I)
    gate_up = skinny_matmul(x, w, config=config, **kw)
    ref = ((F.silu(gate_up[:, :I].float()).to(dtype).float()) * gate_up[:, I:].float()).to(dtype)
    out = skinny_matmul(x, w, silu_out=True, config=config, **kw)
    assert out.shape == (M, I)
    _close(out, ref, dtype)


def test_silu_in_the_epilogue_is_refused_where_no_tile_runs():
    x, w = torch.randn(1, 64, device=DEV), torch.randn(32, 64, device=DEV)
    with pytest.raises(ValueError, match="SiLU in the epilogue"):
        skinny_matmul(x, w, silu_out=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pro", ["none", "norm", "silu"])
# streamed: 1 or 2 programs per SM, the row in three tiles or in one (quantized once for every row block)
@pytest.mark.parametrize("config", [(8, 128, 1, 4, 1), (4, 256, 1, 4, 2), (8, 512, 1, 4, 1)])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("dp4a", ["1", "all", "0"])  # dp4a where the row is one tile, everywhere, nowhere
def test_streamed_int4_row_matches_the_dequantized_linear(dtype, pro, config, group, dp4a, monkeypatch):
    """One activation row of INT4 weights streamed block after block (the tile in flight before it is used),
    with each prologue, at a K that is not a whole number of tiles: on dp4a (W4A8) against the activations
    quantized per 32 columns, else (W4A16) against the activations as they are."""
    monkeypatch.setenv("O3EDGE_INT4_DP4A", dp4a)
    N, K = 72, 320
    g, x, w = _data(1, N, K, dtype, 11, x_cols=2 * K if pro == "silu" else K)
    qw, sz = quantize_int4(w.float().cpu(), group)
    dq = dequantize_int4(qw, sz, K).to(dtype).float().to(DEV)
    kw = dict(scales_and_zeros=sz.to(DEV), group_size=group, out_features=N, config=config)
    if pro == "norm":
        res = torch.randn(1, K, generator=g).to(DEV, dtype)
        nw = (1 + 0.1 * torch.randn(K, generator=g)).to(DEV, dtype)
        out, new_res = skinny_matmul(x, qw.to(DEV), norm_weight=nw, residual=res.clone(), eps=1e-5, **kw)
        act = add_rmsnorm_reference(x, res.clone(), nw, 1e-5)
        _close(new_res, x.float() + res.float(), dtype)
    elif pro == "silu":
        out, act = skinny_matmul(x, qw.to(DEV), silu=True, **kw), silu_mul_reference(x)
    else:
        out, act = skinny_matmul(x, qw.to(DEV), **kw), x
    on_dp4a = dp4a == "all" or dp4a == "1" and K <= config[1]
    _close(out, F.linear(act_quantized(act) if on_dp4a else act.float(), dq), dtype)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_row_of_several_tiles_on_dp4a_quantizes_each_tile_in_turn(weights, monkeypatch):
    """One row in three tiles on dp4a (INT4 only with O3EDGE_INT4_DP4A=all), with the SiLU prologue: each tile's
    activations quantized as its turn comes, against the activations quantized per 32 columns."""
    monkeypatch.setenv("O3EDGE_INT4_DP4A", "all")
    N, K, dtype = 40, 320, DTYPES[0]
    g, x, w = _data(1, N, K, dtype, 17, x_cols=2 * K)
    if weights == "int4":
        qw, sz = quantize_int4(w.float().cpu(), 64)
        dq = dequantize_int4(qw, sz, K).to(dtype).float().to(DEV)
        kw = dict(scales_and_zeros=sz.to(DEV), group_size=64, out_features=N)
    else:
        qw, s8, dq = _int8(w)
        kw = dict(scales8=s8)
    out = skinny_matmul(x, qw.to(DEV), silu=True, config=(8, 128, 1, 4, 1), **kw)
    _close(out, F.linear(act_quantized(silu_mul_reference(x)), dq), dtype)


@pytest.mark.parametrize("weights", ["dense", "int4", "int8"])
@pytest.mark.parametrize("splits", [2, 3])
def test_a_row_split_along_k_over_programs_sums_its_parts_in_order(weights, splits):
    """One row whose K tiles are split over programs (a streamed plan's third entry): each row block's parts summed
    by its last to finish, with the SiLU prologue and a bias, at a K of 2.5 tiles (splits 2: the second part's
    second tile past K) and 9 row blocks on 4 programs. Repeated calls give the same bits (the parts are summed
    in order whichever finishes last; the arrival counters are left at zero). INT4 in three parts runs on dp4a
    (each part one tile), in two on the activations as they are."""
    N, K, dtype = 72, 320, DTYPES[0]
    g, x, w = _data(1, N, K, dtype, 23, x_cols=2 * K)
    bias = torch.randn(N, generator=g).to(DEV, dtype)
    act = silu_mul_reference(x)
    if weights == "int4":
        qw, sz = quantize_int4(w.float().cpu(), 64)
        w, kw = qw.to(DEV), dict(scales_and_zeros=sz.to(DEV), group_size=64, out_features=N)
        dq = dequantize_int4(qw, sz, K).to(dtype).float().to(DEV)
        act = act_quantized(act) if splits == 3 else act.float()
    elif weights == "int8":
        w, s8, dq = _int8(w)
        kw = dict(scales8=s8)
        act = act_quantized(act)
    else:
        kw, dq = {}, w.float()
    runs = [skinny_matmul(x, w, silu=True, bias=bias, config=(8, 128, splits, 4, 1), **kw) for _ in range(3)]
    _close(runs[0], F.linear(act.float(), dq, bias.float()), dtype)
    assert all(torch.equal(r, runs[0]) for r in runs[1:])


def test_int4_dp4a_reads_every_code_and_both_nibbles_of_a_byte():
    """W4A8 on one row with codes 0 and 15 at both ends and a different scale and zero per group: exact against
    the dequantized weight when the activations are exact in INT8 (their group's largest is 127 times a power
    of two)."""
    N, K, group = 16, 128, 32
    codes = torch.arange(N * K).remainder(16).view(N, K).flip(1)
    codes[:, :8] = torch.tensor([0, 15, 15, 0, 0, 0, 15, 15])
    scale = torch.tensor([0.5, 0.25, 1.0, 2.0]).repeat(N, 1).to(torch.bfloat16)  # [N, groups]
    zero = torch.tensor([-1.0, 0.5, 3.0, -0.25]).repeat(N, 1).to(torch.bfloat16)
    from o3edge.engine.quant import pack_int4

    qw, sz = pack_int4(codes.to(torch.uint8), scale, zero)
    dq = dequantize_int4(qw, sz, K).float()
    x = torch.randint(-127, 128, (1, K)).float() / 64
    x.view(-1, 32)[:, 0] = 127 / 64  # every activation group's largest: its codes are x * 64 exactly
    out = skinny_matmul(x.to(DEV), qw.to(DEV), scales_and_zeros=sz.to(DEV), group_size=group, out_features=N,
                        config=(8, 128, 1, 4, 1))
    torch.testing.assert_close(out.float().cpu(), F.linear(x, dq), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [2, 5, 8])
@pytest.mark.parametrize("config", [(8, 128, 1, 4, 1), (4, 256, 1, 4, 2)])  # 1 or 2 programs per SM
@pytest.mark.parametrize("unroll", ["0", "1"])  # the rows in a loop, or unrolled
def test_streamed_int4_rows_match_the_dequantized_linear(dtype, M, config, unroll, monkeypatch):
    """A few activation rows of INT4 weights streamed without the tensor cores (each tile dequantized once,
    then used by every row), at a K that is not a whole number of tiles; and the planned tiling."""
    monkeypatch.setenv("O3EDGE_INT4_ROWS", "8")
    monkeypatch.setenv("O3EDGE_INT4_ROWS_UNROLL", unroll)
    N, K, group = 72, 320, 64
    g, x, w = _data(M, N, K, dtype, 13 + M)
    qw, sz = quantize_int4(w.float().cpu(), group)
    ref = F.linear(x.float(), dequantize_int4(qw, sz, K).to(dtype).float().to(DEV))
    for cfg in (config, None):
        out = skinny_matmul(x, qw.to(DEV), scales_and_zeros=sz.to(DEV), group_size=group, out_features=N, config=cfg)
        _close(out, ref, dtype)


def test_streamed_int4_rows_take_no_prologue():
    qw, sz = quantize_int4(torch.randn(8, 64), 64)
    with pytest.raises(ValueError, match="no prologue"):
        skinny_matmul(torch.zeros(4, 128, device=DEV), qw.to(DEV), scales_and_zeros=sz.to(DEV), group_size=64,
                      out_features=8, silu=True, config=(8, 64, 1, 4, 1))


def _int8(w):
    """(codes int8 [N, K], scales float32 [N]) on the kernel device, and the dequantized weight in float32."""
    from o3edge.engine.cpu_quant import dequantize_int8, quantize_int8

    q, s = quantize_int8(w.float().cpu())
    return q.to(DEV), s.to(DEV), dequantize_int8(q, s).to(DEV)


# planned, split-K (the last split sums scaled partials), and at one row streamed (sums deferred or per tile)
INT8_TILINGS = [(M, config) for M in (1, 3, 16, 33)
                for config in (None, (16, 64, 4, 4)) + (((8, 64, 1, 4, 1), (16, 512, 1, 1, 1)) if M == 1 else ())]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,config", INT8_TILINGS)
@pytest.mark.parametrize("pro", ["none", "norm", "silu"])
@pytest.mark.parametrize("K", [320, 150])  # one row streamed: dp4a on whole activation groups; else in float
def test_int8_weights_match_the_dequantized_linear(dtype, M, config, pro, K):
    """INT8 codes with per-row scales, with each prologue, as the decode step runs them: prologue(x) @ (q * scale).T,
    the activations in the model dtype (W8A16), or, for one row streamed on dp4a, quantized per 32 columns (W8A8)."""
    N = 136
    dp4a = M == 1 and K % 32 == 0 and (config is None or len(config) > 4)
    g, x, w = _data(M, N, K, dtype, M + N, x_cols=2 * K if pro == "silu" else K)
    q, s, wq = _int8(w)
    kw = dict(scales8=s, config=config)
    if pro == "norm":
        res = torch.randn(M, K, generator=g).to(DEV, dtype)
        nw = (1 + 0.1 * torch.randn(K, generator=g)).to(DEV, dtype)
        out, _ = skinny_matmul(x, q, norm_weight=nw, residual=res.clone(), eps=1e-5, **kw)
        act = add_rmsnorm_reference(x, res.clone(), nw, 1e-5)
    elif pro == "silu":
        out, act = skinny_matmul(x, q, silu=True, **kw), silu_mul_reference(x)
    else:
        out, act = skinny_matmul(x, q, **kw), x
    assert out.dtype == dtype and out.shape == (M, N)
    _close(out, F.linear(act_quantized(act) if dp4a else act.float(), wq), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 130])  # decode rows on the skinny kernel; prefill's dequantized copy
def test_int8_linear_on_triton_matches_its_dequantized_weight(dtype, rows):
    from o3edge.engine.cpu_quant import Int8Linear

    g, _, w = _data(1, 96, 160, dtype, rows)
    q, s, wq = _int8(w)
    layer = Int8Linear(160, 96, "triton")
    layer.load_quantized(q, s)
    x = torch.randn(2, rows, 160, generator=g).to(DEV, dtype)
    out = layer(x)
    assert out.shape == (2, rows, 96) and out.dtype == dtype
    _close(out, x.float() @ wq.T, dtype)


def test_int8_codes_are_read_exactly_at_both_ends():
    """Codes -127, -1, 0, 1 and 127 on one row each, scale 1: the products are the activations times the codes
    exactly (the bit trick that turns a code into a float must not be off by one anywhere)."""
    K = 64
    codes = torch.tensor([-127, -1, 0, 1, 127, -128 + 1, 5, -5], dtype=torch.int8)
    q = codes[:, None].expand(-1, K).contiguous().to(DEV)
    x = torch.zeros(1, K, device=DEV)
    x[0, 3] = 1.0
    out = skinny_matmul(x, q, scales8=torch.ones(len(codes), device=DEV))
    assert out[0].cpu().tolist() == codes.float().tolist()


def test_more_rows_than_a_decode_batch_are_refused():
    x, w = torch.zeros(65, 8, device=DEV), torch.zeros(8, 8, device=DEV)
    with pytest.raises(ValueError, match="at most 64"):
        skinny_matmul(x, w)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_planned_tilings_at_model_shapes_on_the_gpu(dtype, monkeypatch):
    """tinyllama's one-row projections as the decode step runs them (streamed dense, INT4 on dp4a, with the
    packed dot and without; llama-1b's INT4 down split along K), its INT4 projections at 8 and 32 rows (planned tiles, then never swapped) and at
    2-8 rows streamed (rows_int4), against prologue-then-linear in float32."""
    monkeypatch.setenv("O3EDGE_INT4_PACKED", "1")
    g, x, w = _data(1, 2560, 2048, dtype, 7)
    res = torch.randn(1, 2048, generator=g).to(DEV, dtype)
    nw = (1 + 0.1 * torch.randn(2048, generator=g)).to(DEV, dtype)
    out, _ = skinny_matmul(x, w, norm_weight=nw, residual=res.clone(), eps=1e-5)
    normed = add_rmsnorm_reference(x, res.clone(), nw, 1e-5)
    _close(out, F.linear(normed.float(), w.float()), dtype)
    g, gu, w = _data(1, 2048, 5632, dtype, 8, x_cols=2 * 5632)
    _close(skinny_matmul(gu, w, silu=True), F.linear(silu_mul_reference(gu).float(), w.float()), dtype)
    for N, K, group in ((11264, 2048, 128), (2048, 5632, 64), (2048, 8192, 128)):  # llama-1b's down: split in four
        g, x, w = _data(1, N, K, dtype, N)
        qw, sz = quantize_int4(w.float().cpu(), group)
        dq = dequantize_int4(qw, sz, K).to(dtype).float().to(DEV)
        ref, ref_dp4a = F.linear(x.float(), dq), F.linear(act_quantized(x), dq)
        # streamed on dp4a (W4A8: a row of one tile, gate/up) or on the packed dot or not, or not streamed
        for dp4a, packed, stream in itertools.product(("1", "0"), ("1", "0"), ("0", "1", "wide")):
            monkeypatch.setenv("O3EDGE_INT4_DP4A", dp4a)
            monkeypatch.setenv("O3EDGE_INT4_PACKED", packed)
            monkeypatch.setenv("O3EDGE_INT4_STREAM", stream)
            out = skinny_matmul(x, qw.to(DEV), scales_and_zeros=sz.to(DEV), group_size=group, out_features=N)
            # dp4a where a row, or each work item of a split row, is one tile
            _close(out, ref_dp4a if dp4a == "1" and stream != "0" and (K <= 2048 or K % 2048 == 0) else ref, dtype)
        monkeypatch.delenv("O3EDGE_INT4_DP4A")
        for M, asm in itertools.product((2, 8, 32), ("1", "0")):  # decode batches: planned tiles (W @ x.T where
            monkeypatch.setenv("O3EDGE_INT4_ASM", asm)  # it pays), then never swapped; packed dequantize or not
            g, x, _ = _data(M, N, K, dtype, N + M)
            ref = F.linear(x.float(), dequantize_int4(qw, sz, K).to(dtype).float().to(DEV))
            for swap in (None, "0"):
                if swap is not None:
                    monkeypatch.setenv("O3EDGE_INT4_SWAP", swap)
                out = skinny_matmul(x, qw.to(DEV), scales_and_zeros=sz.to(DEV), group_size=group, out_features=N)
                _close(out, ref, dtype)
            monkeypatch.delenv("O3EDGE_INT4_SWAP")
        monkeypatch.setenv("O3EDGE_INT4_ROWS", "8")  # 2-8 rows streamed, no tensor cores (rows_int4)
        for M, unroll in itertools.product((2, 5, 8), ("0", "1")):  # the rows in a loop, or unrolled
            monkeypatch.setenv("O3EDGE_INT4_ROWS_UNROLL", unroll)
            g, x, _ = _data(M, N, K, dtype, N + M)
            ref = F.linear(x.float(), dequantize_int4(qw, sz, K).to(dtype).float().to(DEV))
            out = skinny_matmul(x, qw.to(DEV), scales_and_zeros=sz.to(DEV), group_size=group, out_features=N)
            _close(out, ref, dtype)
        monkeypatch.delenv("O3EDGE_INT4_ROWS")
        monkeypatch.delenv("O3EDGE_INT4_ROWS_UNROLL")
    g, x, w = _data(1, 2560, 2048, dtype, 9)  # an attention projection in INT4 (--int4-all), streamed by default
    qw, sz = quantize_int4(w.float().cpu(), 128)
    dq = dequantize_int4(qw, sz, 2048).to(dtype).float().to(DEV)
    for stream in ("1", "wide"):  # streamed on dp4a, or (wide: only wide layers stream) not streamed
        monkeypatch.setenv("O3EDGE_INT4_STREAM", stream)
        _close(skinny_matmul(x, qw.to(DEV), scales_and_zeros=sz.to(DEV), group_size=128, out_features=2560),
               F.linear(act_quantized(x) if stream == "1" else x.float(), dq), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_planned_int8_tilings_at_model_shapes_on_the_gpu(dtype):
    """INT8 weights as the decode step runs them at tinyllama's and llama-1b's shapes: one row streamed on dp4a
    (PTX, which the interpreter never runs) with each prologue, against prologue, activations quantized per 32
    columns, then linear on the dequantized weight; tiles of 8 and 32 rows and a prefill's dequantized copy
    against the linear on the dequantized weight."""
    from o3edge.engine.kernels.int8_matmul import int8_matmul

    for N, K, pro in ((2560, 2048, "norm"), (2048, 2048, "none"), (2048, 5632, "silu"), (32000, 2048, "norm"),
                      (16384, 2048, "norm"), (2048, 8192, "silu")):
        g, x, w = _data(1, N, K, dtype, N + K, x_cols=2 * K if pro == "silu" else K)
        q, s, wq = _int8(w)
        if pro == "norm":
            res = torch.randn(1, K, generator=g).to(DEV, dtype)
            nw = (1 + 0.1 * torch.randn(K, generator=g)).to(DEV, dtype)
            out, _ = skinny_matmul(x, q, norm_weight=nw, residual=res.clone(), eps=1e-5, scales8=s)
            act = add_rmsnorm_reference(x, res.clone(), nw, 1e-5)
        elif pro == "silu":
            out, act = skinny_matmul(x, q, silu=True, scales8=s), silu_mul_reference(x)
        else:
            out, act = skinny_matmul(x, q, scales8=s), x
        _close(out, F.linear(act_quantized(act), wq), dtype)
        for M in (8, 32, 100):
            xm = torch.randn(M, K, generator=g).to(DEV, dtype)
            _close(int8_matmul(xm, q, s), F.linear(xm.float(), wq), dtype)
