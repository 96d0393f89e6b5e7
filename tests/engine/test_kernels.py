"""The CUDA decode step's Triton kernels against plain-torch references.

On a machine without CUDA they run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1,
set in tests/conftest.py before any kernel is defined), so CI checks the same code the GPU runs; on
the GPU machine (`pytest -m gpu`) the same cases run compiled.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import KERNEL_DEVICE, KERNEL_DTYPES, act_quantized, require_triton

triton = require_triton()

from o3edge.engine.kernels.activation import silu_mul, silu_mul_reference  # noqa: E402
from o3edge.engine.kernels.argmax import float_logits_and_argmax  # noqa: E402
from o3edge.engine.kernels.int4_matmul import int4_matmul  # noqa: E402
from o3edge.engine.kernels.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from o3edge.engine.kernels.norm import add_rmsnorm, add_rmsnorm_reference  # noqa: E402

DEV, DTYPES = KERNEL_DEVICE, KERNEL_DTYPES
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [256, 576, 2048])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_matches_reference(dtype, D, with_residual):
    g = torch.Generator().manual_seed(D)
    x = torch.randn(3, D, generator=g).to(DEV, dtype)
    res = torch.randn(3, D, generator=g).to(DEV, dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(DEV, dtype)
    res_ref = res.clone() if with_residual else None
    out = add_rmsnorm(x, res, w, 1e-5)
    ref = add_rmsnorm_reference(x, res_ref, w, 1e-5)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if with_residual:  # the residual stream is updated in place, exactly as the eager add
        torch.testing.assert_close(res, res_ref, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [704, 1536, 5632])
def test_silu_mul_matches_reference(dtype, inter):
    gu = torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(DEV, dtype)
    torch.testing.assert_close(silu_mul(gu).float(), silu_mul_reference(gu).float(), atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [2048, 32000, 49152 + 7])
def test_float_logits_and_argmax_match_torch(dtype, V):
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(V)).to(DEV, dtype)
    logits[1, 5] = logits[1, V - 3] = logits[1].max() + 1  # a tie across chunks: the first index wins
    logits[2] = 0.0  # all equal: index 0, as torch.argmax
    out, tokens = float_logits_and_argmax(logits)
    assert torch.equal(out, logits.float())
    assert tokens.tolist() == logits.float().argmax(-1).tolist() == [tokens[0].item(), 5, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K,group", [
    (1, 256, 704, 32),      # the tiny model's down projection: K padded up to the group
    (3, 1408, 256, 64),     # a few decode streams
    (32, 512, 2048, 128),   # batch 32: GEMM tiles
    (70, 96, 384, 128),     # rows and columns that fill no tile
    (100, 8192, 128, 64),   # a prompt chunk through gate/up: tiles dequantized in registers (prefill_tiling)
    (128, 48, 4096, 128),   # and through down: tiles, K split in four
])
def test_int4_matmul_matches_dequantized_reference(dtype, M, N, K, group):
    from o3edge.engine.quant import dequantize_int4, quantize_int4

    g = torch.Generator().manual_seed(M * N)
    qweight, sz = quantize_int4(torch.randn(N, K, generator=g) * 0.05, group)
    x = torch.randn(M, K, generator=g).to(dtype)
    act = act_quantized(F.pad(x, (0, -K % 32)))[:, :K] if M == 1 else x.float()  # one row on dp4a (W4A8)
    ref = act @ dequantize_int4(qweight, sz, K).T
    out = int4_matmul(x.to(DEV), qweight.to(DEV), sz.to(DEV), group, N)
    assert out.dtype == dtype and out.shape == (M, N)
    scale = ref.abs().max()
    torch.testing.assert_close(out.float().cpu() / scale, ref / scale, atol=TOL[dtype] * 2, rtol=0)


def test_int4_prompt_chunks_run_on_tiles_only_where_they_were_faster(monkeypatch):
    """prefill_tiling: 65-128 rows of gate/up (many output rows) and down (long rows) on tiles; QKV, o, decode
    batches and longer chunks keep their paths. Never with O3EDGE_INT4_PREFILL_TILES=0."""
    from o3edge.engine.kernels.gemv import prefill_tiling

    assert prefill_tiling(128, 11264, 2048) and prefill_tiling(65, 2048, 5632)
    assert not any(prefill_tiling(*s) for s in [(128, 2560, 2048), (128, 2048, 2048), (64, 11264, 2048),
                                                (129, 11264, 2048)])
    monkeypatch.setenv("O3EDGE_INT4_PREFILL_TILES", "0")
    assert prefill_tiling(128, 11264, 2048) is None


def _decode_case(lens, H, KVH, HD, block_size, dtype, seed=0):
    """A paged cache with scattered blocks holding len-1 cached keys per sequence, and a step."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    slots = (num_blocks + 1) * block_size
    k_cache = torch.randn(slots, KVH, HD, generator=g).to(DEV, dtype)
    v_cache = torch.randn(slots, KVH, HD, generator=g).to(DEV, dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # blocks out of order, as a real pool
    meta = torch.zeros(len(lens), 3 + max_blocks, dtype=torch.int32)
    for b, n in enumerate(lens):
        table = [perm.pop() for _ in range(-(-n // block_size))]
        meta[b, 3:3 + len(table)] = torch.tensor(table, dtype=torch.int32)
        pos = n - 1
        meta[b, 0], meta[b, 1], meta[b, 2] = 7, pos, table[pos // block_size] * block_size + pos % block_size
    qkv = torch.randn(len(lens), (H + 2 * KVH) * HD, generator=g).to(DEV, dtype)
    t = torch.arange(4096, dtype=torch.float32)[:, None] * (1e4 ** (-torch.arange(0, HD, 2) / HD))[None]
    emb = torch.cat((t, t), dim=-1)
    return qkv, emb.cos().to(DEV, dtype), emb.sin().to(DEV, dtype), meta.to(DEV), k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,H,KVH,HD,block_size,splits", [
    ([1, 2, 17, 33], 8, 2, 32, 16, 1),      # first token alone, block boundaries (16/17, 32/33)
    ([130, 5], 32, 4, 64, 16, 1),          # tinyllama's GQA ratio (8)
    ([300, 64, 1], 32, 8, 64, 16, 4),      # split along the key axis; empty splits for short rows
    ([97, 777], 4, 4, 32, 32, 3),          # MHA, splits that do not divide the length
    ([1100, 600, 3], 8, 2, 64, 16, 4),     # 4, 3 and 1 splits with keys in one step
    ([70, 12], 4, 1, 128, 16, 2),          # one KV head for all (GQA 4), head_dim 128
    ([300], 32, 4, 64, 16, 4),             # one row: first tiles loaded before the wait; the last split empty
    ([1], 8, 2, 32, 16, 3),                # one row, the first token: every split empty
])
def test_decode_attention_matches_reference(dtype, lens, H, KVH, HD, block_size, splits):
    qkv, cos, sin, meta, kc, vc = _decode_case(lens, H, KVH, HD, block_size, dtype, seed=len(lens))
    kr, vr = kc.clone(), vc.clone()
    out = decode_attention(qkv, cos, sin, meta, kc, vc, H, block_size, num_splits=splits)
    ref = decode_attention_reference(qkv, cos, sin, meta, kr, vr, H, block_size)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype] * 5, rtol=TOL[dtype] * 5)
    # nothing left behind changes the next step (a graph replay of the same step)
    assert torch.equal(decode_attention(qkv, cos, sin, meta, kc, vc, H, block_size, num_splits=splits), out)
    # the new keys and values landed in their slots (RoPE applied to keys), nothing else changed
    torch.testing.assert_close(kc.float(), kr.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(vc, vr)


def test_decode_attention_with_qk_norm_matches_reference():
    qkv, cos, sin, meta, kc, vc = _decode_case([40, 3], 4, 2, 96, 16, torch.float32)
    HD = kc.shape[-1]
    g = torch.Generator().manual_seed(3)
    qn, kn = (1 + 0.1 * torch.randn(HD, generator=g)).to(DEV), (1 + 0.1 * torch.randn(HD, generator=g)).to(DEV)
    kr, vr = kc.clone(), vc.clone()
    out = decode_attention(qkv, cos, sin, meta, kc, vc, 4, 16, q_norm=qn, k_norm=kn, eps=1e-6)
    ref = decode_attention_reference(qkv, cos, sin, meta, kr, vr, 4, 16, q_norm=qn, k_norm=kn, eps=1e-6)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kc, kr, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_rows_take_their_token_from_the_metadata_or_the_step_before(dtype):
    """kernels/embedding.py: a metadata token >= 0 is the row's token; -(r + 1) is row r of `last`."""
    from o3edge.engine.kernels.embedding import embed_rows, embed_rows_reference

    g = torch.Generator().manual_seed(5)
    weight = torch.randn(300, 1100, generator=g).to(DEV, dtype)  # two column blocks, the second partial
    meta = torch.zeros(5, 7, dtype=torch.int32)
    meta[:, 0] = torch.tensor([17, -3, 0, -1, 299])
    last = torch.tensor([250, 3, 123, 9], device=DEV)
    out = embed_rows(weight, meta.to(DEV), last)
    torch.testing.assert_close(out, embed_rows_reference(weight, meta.to(DEV), last), atol=0, rtol=0)
    torch.testing.assert_close(out[1], weight[123], atol=0, rtol=0)


@pytest.mark.parametrize("prompt_texts", [["def main(argv):\n", "class Queue:\n    \"\"\"A FIFO", "x"],
                                   ["def main(argv):\n"]])  # one row: the skinny matmuls with norm/SiLU fused in
def test_static_decode_step_gives_the_eager_engines_tokens(checkpoints, prompt_texts):
    """The fused decode step (the graph's body, here run uncaptured) against the eager engine:
    same greedy tokens for a batch of different lengths, across block boundaries."""
    from o3edge import O3Config, O3Model
    from o3edge.engine.sequence import SamplingParams

    path = checkpoints("qwen3-qknorm")  # q/k norm, untied head, head_dim 96, GQA 2
    cfg = dict(model_path=path, device=DEV, dtype="float32", kv_cache_memory_mb=16, max_model_len=256,
               cuda_graphs=False)
    fused, eager = O3Model.from_config(O3Config(**cfg)), O3Model.from_config(O3Config(**cfg))
    fused.engine.runner.enable_static_decode(4, capture=False)
    fused.engine.runner.graphs.fused = True  # as on CUDA
    prompts = [fused.engine.encode(p) for p in prompt_texts]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    a = [r.token_ids for r in fused.generate_batch(prompts, params)]
    b = [r.token_ids for r in eager.generate_batch(prompts, params)]
    assert fused.engine.runner.graphs.num_steps >= 11
    assert a == b


def _neutral_int4(w: torch.Tensor, group: int):
    """An Int4Linear holding w in the device-neutral form its Triton kernels read (as load_quantized leaves
    it on CUDA), on the kernels' device."""
    from o3edge.engine.quant import Int4Linear, quantize_int4

    mod = Int4Linear(w.shape[1], w.shape[0], group)
    qw, sz = quantize_int4(w.float().cpu(), group)
    mod.weight, mod.scales_and_zeros, mod.neutral = qw.to(DEV), sz.to(DEV), True
    return mod


@pytest.mark.parametrize("rows", [2, 5, 32])
def test_int4_mlp_with_silu_in_the_gate_up_epilogue_equals_it_with_a_silu_mul_kernel(rows, monkeypatch):
    """The decode step's MLP over INT4 gate/up and down at 2-64 rows: with SiLU·mul made in the gate/up
    tiles' epilogue (no kernel of its own: decode_step.silu_epilogue) it gives the same output and residual
    stream as the projection followed by the SiLU·mul kernel. Two rows take the streamed kernel: no
    epilogue there."""
    from types import SimpleNamespace

    from o3edge.engine.decode_step import Step, silu_epilogue

    dtype, D, inter, group = torch.float16, 128, 96, 32
    g = torch.Generator().manual_seed(rows)
    mlp = SimpleNamespace(gate_up=_neutral_int4(torch.randn(2 * inter, D, generator=g) / D ** 0.5, group),
                          down=_neutral_int4(torch.randn(D, inter, generator=g) / inter ** 0.5, group))
    x, res = (torch.randn(rows, D, generator=g).to(DEV, dtype) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(D, generator=g)).to(DEV, dtype)
    outs = {}
    for on in ("1", "0"):
        monkeypatch.setenv("O3EDGE_INT4_SILU_EPILOGUE", on)
        assert silu_epilogue(mlp.gate_up, rows) == (on == "1" and rows != 2)
        r = res.clone()
        outs[on] = Step(1e-5, rows, fused=True).mlp(x, r, nw, mlp)
    (h1, r1), (h0, r0) = outs["1"], outs["0"]
    torch.testing.assert_close(r1, r0, atol=0, rtol=0)
    torch.testing.assert_close(h1.float(), h0.float(), atol=2e-3, rtol=2e-3)
