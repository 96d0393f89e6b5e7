"""Calibrated INT4 (gptq.py): the format of quantize_int4 with smaller errors, and the cpu-int4-all preset built
with it (every linear and the LM head INT4, GPTQ at build time)."""

import dataclasses

import pytest
import torch

from o3edge import O3Config, O3Model
from o3edge.engine import cpu_ext, cpu_quant, gptq
from o3edge.engine.cpu_quant import Int8Linear
from o3edge.engine.engine_dir import build_engine_dir, read_manifest
from o3edge.engine.precision import alignment_report
from o3edge.engine.quant import Int4Linear, dequantize_int4, quantize_int4
from o3edge.engine.sequence import SamplingParams

CALIBRATION_TOKENS = 4096  # 8 windows: enough for a tiny model, seconds to build


def weights(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02


def inputs(rows, k, seed=1):
    """Activations with correlated features and a few outlier channels, as a real layer's inputs have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k // 8, generator=g) @ torch.randn(k // 8, k, generator=g)
    x = x + 0.3 * torch.randn(rows, k, generator=g)
    x[:, :4] *= 10
    return x


def same_format(a, b):
    return all(x.dtype == y.dtype and x.shape == y.shape for x, y in zip(a, b))


@pytest.mark.parametrize("group", [32, 128])
def test_searched_scales_keep_the_format_and_lower_the_weight_error(group):
    w = weights(64, 576)  # 576: padded groups too
    rtn, mse = quantize_int4(w, group), gptq.quantize_mse(w, group)
    assert same_format(rtn, mse)

    def err(q):
        return (dequantize_int4(*q, 576) - w).square().sum()

    assert err(mse) < 0.9 * err(rtn)


def test_gptq_lowers_the_layer_output_error_and_is_deterministic():
    w, x = weights(96, 256), inputs(2048, 256)
    hessian = x.t() @ x

    def out_err(q):
        return (x @ (dequantize_int4(*q, 256) - w).t()).square().mean()

    rtn, mse = quantize_int4(w, 32), gptq.quantize_mse(w, 32)
    first, again = gptq.quantize_gptq(w, hessian, 32), gptq.quantize_gptq(w, hessian, 32)
    assert same_format(rtn, first) and all(torch.equal(a, b) for a, b in zip(first, again))
    assert out_err(first) < 0.7 * min(out_err(rtn), out_err(mse))
    assert out_err(gptq.quantize_gptq(w, hessian, 32, search=False)) < out_err(rtn)


def test_gptq_needs_calibration_windows():
    with pytest.raises(ValueError, match="calibration"):
        gptq.calibrate(torch.nn.Module(), [], ["layers.0.mlp.down"], 32, "gptq-mse")


@pytest.fixture(scope="module")
def int4_all(checkpoints, tmp_path_factory):
    """method -> engine directory of the llama-tied checkpoint with every linear and the LM head INT4 g32:
    "gptq-mse" is the cpu-int4-all preset, "rtn" the same layout by round to nearest."""
    root, src = tmp_path_factory.mktemp("int4-all"), checkpoints("llama-tied")
    built = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(cpu_quant.PRESETS, "rtn-all", dataclasses.replace(cpu_quant.PRESETS["cpu-int4-all"],
                                                                       name="rtn-all", int4_method="rtn"))
        for method, preset in (("gptq-mse", "cpu-int4-all"), ("rtn", "rtn-all")):
            built[method] = str(root / method)
            build_engine_dir(src, built[method], torch.bfloat16, None, preset=preset,
                             calibration_tokens=CALIBRATION_TOKENS)
    return built


def test_int4_all_preset_stores_every_linear_in_int4_and_runs_natively(int4_all):
    path = int4_all["gptq-mse"]
    m = read_manifest(path)
    assert m.preset == "cpu-int4-all" and m.int8_modules == () and m.group_size == 32
    assert "lm_head" in m.quantized and len(m.quantized) == 4 * m.args.num_layers + 1
    int4 = m.raw["quantization"]["int4"]
    assert int4["method"] == "gptq-mse" and int4["calibration"]["tokens"] == CALIBRATION_TOKENS
    o3 = O3Model.from_config(O3Config(backend="torch", model_path=path, device="cpu"))
    engine, model = o3.engine, o3.engine.runner.model
    assert sorted(n for n, mod in model.named_modules() if isinstance(mod, Int4Linear)) == sorted(m.quantized)
    assert not any(isinstance(mod, (Int8Linear, torch.nn.Linear)) for mod in model.modules())
    assert model.embed.weight.dtype == torch.float32  # the tied embedding stays dense for the lookup
    if cpu_ext.available():
        assert engine.runner.cpu_decode.native is not None
    out = o3.generate_batch([engine.encode("def main():")], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert out[0].completion_tokens == 12


def test_int4_all_preset_is_closer_to_float32_than_round_to_nearest(int4_all, checkpoints):
    settings = dict(device="cpu", kv_cache_memory_mb=16, max_model_len=256)
    ref = O3Model.from_config(O3Config(model_path=checkpoints("llama-tied"), dtype="float32", **settings)).engine
    kl = {method: alignment_report(ref, O3Model.from_config(O3Config(backend="torch", model_path=path,
                                                                     **settings)).engine, num_new_tokens=8).kl_mean
          for method, path in int4_all.items()}
    assert kl["gptq-mse"] < 0.8 * kl["rtn"], kl


@pytest.mark.parametrize("variant", ["qwen2-bias", "qwen3-qknorm"])
def test_int4_all_preset_on_untied_and_biased_models(checkpoints, tmp_path, variant):
    """An untied LM head is INT4 as it is; a qkv with a bias (Qwen2) stays dense, the rest INT4."""
    path = str(tmp_path / variant)
    m = build_engine_dir(checkpoints(variant), path, torch.bfloat16, None, preset="cpu-int4-all",
                         calibration_tokens=CALIBRATION_TOKENS)
    biased = variant == "qwen2-bias"
    assert "lm_head" in m.quantized and m.int8_modules == ()
    assert len(m.quantized) == (3 if biased else 4) * m.args.num_layers + 1
    model = O3Model.from_config(O3Config(backend="torch", model_path=path, device="cpu"))
    ids = model.engine.encode("import os")
    assert model.generate_batch([ids], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].completion_tokens == 6
