"""INT4 weight-only quantization: the format, the error it makes, and Int4Linear against plain math."""

import pytest
import torch

from o3edge import O3Config, O3Model
from o3edge.engine import cpu_quant
from o3edge.engine.quant import (GROUP_SIZES, Int4Linear, dequantize_int4, int4_tag, quantize_int4,
                                 unpack_nibbles)


def weights(n, k, seed=0, std=0.02, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * std + shift


def group_view(w, g):
    return torch.nn.functional.pad(w, (0, -w.shape[1] % g)).view(w.shape[0], -1, g)


@pytest.mark.parametrize("group", GROUP_SIZES)
@pytest.mark.parametrize("std,shift", [(0.02, 0.0), (1.0, 0.0), (0.5, 40.0)])
def test_dequantized_error_is_within_half_a_step(group, std, shift):
    """Each weight lands within half a quantization step of itself (plus bf16 rounding of scale/zero)."""
    w = weights(64, 576, std=std, shift=shift)  # 576 is not a multiple of 128 or 256: padded groups too
    qweight, sz = quantize_int4(w, group)
    deq = dequantize_int4(qweight, sz, 576)
    assert deq.shape == w.shape
    wg = group_view(w, group)
    step = (wg.amax(-1) - wg.amin(-1)) / 15  # [N, G]
    bound = 0.5 * step + 2**-8 * wg.abs().amax(-1)
    err = group_view((deq - w).abs(), group).amax(-1)
    assert (err <= bound).all()


def test_format_is_the_one_torch_packers_read():
    """uint8 [N, Kp/2] with column 2i in the high nibble; bf16 scales and zeros [Kp/g, N, 2]."""
    w = weights(32, 100)
    qweight, sz = quantize_int4(w, 32)
    assert qweight.dtype == torch.uint8 and qweight.shape == (32, 64)  # K padded 100 -> 128
    assert sz.dtype == torch.bfloat16 and sz.shape == (4, 32, 2)
    q = unpack_nibbles(qweight)
    assert torch.equal(((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8), qweight)
    # the dequantization rule the kernels use, written out for one element
    n, k = 5, 37
    scale, zero = sz[k // 32, n].float()
    assert dequantize_int4(qweight, sz, 100)[n, k] == (q[n, k] - 8) * scale + zero


def test_constant_group_dequantizes_exactly():
    w = torch.full((16, 64), 0.5)
    w[:, 32:] = -1.25
    assert torch.equal(dequantize_int4(*quantize_int4(w, 32), 64), w)


@pytest.mark.parametrize("n,k,group", [(1408, 256, 32), (256, 704, 64), (3072, 576, 128), (576, 1536, 256),
                                       (32, 100, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_matches_dequantized_reference_cpu(n, k, group, dtype, monkeypatch):
    """torch's int4pack kernel computes x_bf16 @ dequant(W).T in float32 and rounds once to bf16: the same math.
    (o3edge's VNNI kernel, the default where the CPU has it, rounds activations to int8: tests/engine/test_cpu_ext.py.)"""
    monkeypatch.setattr(cpu_quant, "vnni_fits", lambda *shape: False)
    w = weights(n, k, seed=n + k)
    layer = Int4Linear(k, n, group)
    layer.load_quantized(*quantize_int4(w, group))
    x = weights(7, k, seed=1, std=1.0).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (7, n)
    ref = (x.to(torch.bfloat16).float() @ dequantize_int4(*quantize_int4(w, group), k).T).to(torch.bfloat16)
    # one bf16 rounding of a float32 sum whose order differs: at most about one bf16 ulp apart
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=1e-5)


def test_int4_linear_keeps_leading_dims():
    layer = Int4Linear(64, 32, 32)
    layer.load_quantized(*quantize_int4(weights(32, 64), 32))
    x = weights(6, 64, seed=3, std=1.0)
    assert torch.equal(layer(x.view(2, 3, 64)), layer(x).view(2, 3, 32))


def test_int4_linear_refuses_wrong_shapes():
    with pytest.raises(ValueError):
        Int4Linear(64, 24, 32)  # rows must come in multiples of 16 for the CPU packer
    layer = Int4Linear(64, 32, 32)
    with pytest.raises(ValueError, match="qweight"):
        layer.load_quantized(*quantize_int4(weights(32, 128), 32))


def test_int4_ffn_at_load_swaps_only_the_ffn(tiny_dir):
    model = O3Model.from_config(O3Config(model_path=tiny_dir, device="cpu", dtype="float32", int4_ffn=True,
                                         int4_group_size=64))
    net = model.engine.runner.model
    for layer in net.layers:
        assert isinstance(layer.mlp.gate_up, Int4Linear) and layer.mlp.gate_up.group_size == 64
        assert isinstance(layer.mlp.down, Int4Linear)
        assert type(layer.attn.qkv) is torch.nn.Linear and layer.attn.qkv.weight.dtype == torch.float32
    assert int4_tag(net) == ":int4g64"
    assert model.engine.info.fingerprint.endswith(":int4g64")  # its KV blocks never mix with the dense model's
    assert len(model.generate("import os", max_new_tokens=8).token_ids) == 8


def test_int4_all_quantizes_every_linear_and_an_engine_dir_keeps_them(tiny_dir, tmp_path):
    """int4_all: the attention projections and the (untied) LM head are INT4 too, the fingerprint says so
    (no KV block is shared with the INT4-FFN model), and `o3edge build --int4-all` stores the same set."""
    from o3edge.build_cli import main as build_main

    cfg = dict(model_path=tiny_dir, device="cpu", dtype="float32", int4_ffn=True, int4_group_size=64)
    ffn = O3Model.from_config(O3Config(**cfg))
    every = O3Model.from_config(O3Config(**cfg, int4_all=True))
    net = every.engine.runner.model
    tied = net.lm_head is None
    for layer in net.layers:
        assert all(isinstance(m, Int4Linear) for m in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up,
                                                        layer.mlp.down))
    assert tied or isinstance(net.lm_head, Int4Linear)
    assert int4_tag(net) == ":int4g64:all" and every.engine.info.fingerprint != ffn.engine.info.fingerprint
    out = every.generate("import os", max_new_tokens=8)
    assert len(out.token_ids) == 8
    engine = str(tmp_path / "engine")
    assert build_main(["build", tiny_dir, engine, "--int4-all", "--group-size", "64", "--dtype", "float32"]) == 0
    built = O3Model.from_config(O3Config(model_path=engine, device="cpu", dtype="float32"))
    names = {n for n, m in built.engine.runner.model.named_modules() if isinstance(m, Int4Linear)}
    assert names == {n for n, m in net.named_modules() if isinstance(m, Int4Linear)}
    assert built.generate("import os", max_new_tokens=8).token_ids == out.token_ids


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,group", [(1408, 256, 32), (3072, 576, 128), (576, 1536, 256), (256, 704, 64)])
def test_int4_linear_matches_dequantized_reference_cuda(n, k, group):
    """Quantized on the CPU, packed for CUDA at load (K padded to 128 with zero groups there)."""
    w = weights(n, k, seed=n + k)
    qweight, sz = quantize_int4(w, group)
    layer = Int4Linear(k, n, group)
    layer.load_quantized(qweight.cuda(), sz.cuda())
    x = weights(9, k, seed=1, std=1.0).to(torch.bfloat16)
    y = layer(x.cuda()).cpu()
    ref = x.float() @ dequantize_int4(qweight, sz, k).T
    # tensor cores multiply bf16-rounded dequantized weights: within 1% of the output's scale;
    # a wrong layout or nibble order would be off by the output's own size
    torch.testing.assert_close(y.float(), ref, rtol=2**-6, atol=0.01 * ref.abs().max().item())


@pytest.mark.parametrize("variant", ["llama-tied", "llama3-rope-untied"])
def test_int4_lm_head_quantizes_the_head_only_beside_the_ffn(checkpoints, tmp_path, variant):
    """int4_lm_head: the LM head (a tied one as its own INT4 copy; the embedding stays dense for the lookup) joins
    the INT4 FFN, attention stays dense, the fingerprint differs from INT4-FFN's, and a dense engine directory
    quantized at load gets the same modules and logits as the checkpoint."""
    from o3edge.engine.engine_dir import build_engine_dir

    src = checkpoints(variant)
    cfg = dict(device="cpu", dtype="float32", int4_ffn=True, int4_group_size=32)
    ffn = O3Model.from_config(O3Config(model_path=src, **cfg)).engine
    head = O3Model.from_config(O3Config(model_path=src, int4_lm_head=True, **cfg)).engine
    net = head.runner.model
    assert isinstance(net.lm_head, Int4Linear) and net.embed.weight.dtype == torch.float32
    assert all(type(layer.attn.qkv) is torch.nn.Linear and isinstance(layer.mlp.down, Int4Linear)
               for layer in net.layers)
    assert int4_tag(net) == ":int4g32:head" and head.info.fingerprint != ffn.info.fingerprint
    ids = head.encode("def main():\n    return 1")
    a, b = head.score(ids), ffn.score(ids)
    assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.99  # a quantized head, same model
    engine = str(tmp_path / "dense")
    build_engine_dir(src, engine, torch.float32, None)
    built = O3Model.from_config(O3Config(model_path=engine, int4_lm_head=True, **cfg)).engine
    assert isinstance(built.runner.model.lm_head, Int4Linear)
    torch.testing.assert_close(built.score(ids), a, rtol=0, atol=0)
