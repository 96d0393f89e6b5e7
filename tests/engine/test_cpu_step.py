"""The native CPU decode step ([engine] cpu_native_step, cpu_step.py): the same step as the eager one, and only
where it applies."""

import pytest
import torch

from o3edge import O3Config, O3Model
from o3edge.engine import cpu_ext
from o3edge.engine.engine_dir import build_engine_dir
from o3edge.engine.sequence import SamplingParams

needs_kernels = pytest.mark.skipif(not cpu_ext.available(),
                                   reason="this CPU lacks AVX-512 VNNI and AVX-VNNI (or no g++/ninja)")


@needs_kernels
@pytest.mark.parametrize("variant,preset", [("qwen3-qknorm", "cpu-int4"), ("llama-tied", "cpu-int8"),
                                            ("llama-tied", "cpu-int4-all")])
def test_native_decode_matches_eager(checkpoints, tmp_path, variant, preset):
    """Two sequences of different lengths decode together; the logits of every step equal eager
    decode_forward's on the same INT8/INT4 layers (q/k norms and GQA included), and so do the tokens. The
    native run comes second: its prompts hit the prefix cache, so its keys sit in blocks that are not
    consecutive (read through the block tables), where the eager run had them in one span."""
    path = str(tmp_path / preset)
    build_engine_dir(checkpoints(variant), path, torch.bfloat16, None, preset=preset, calibration_tokens=4096)
    engine = O3Model.from_config(O3Config(backend="torch", model_path=path, device="cpu", kv_block_size=8)).engine
    runner = engine.runner
    native = runner.cpu_decode.native
    assert native is not None
    scattered = []

    def spy(input_ids, positions, cos, sin, step, kv_cache):
        tables = step.tables.tolist()
        scattered.append(any(any(b != t[0] + i for i, b in enumerate(t[:(p // 8) + 1]))
                             for t, p in zip(tables, positions.tolist())))
        return native(input_ids, positions, cos, sin, step, kv_cache)

    prompts = [engine.encode("def main():\n    return the value of the first argument"), engine.encode("import os")]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    logits, tokens, cached = {}, {}, {}
    for use in (None, spy):
        runner.cpu_decode.native = use
        for i, ids in enumerate(prompts):
            engine.add_request(f"{use is None}{i}", ids, params)
        steps, out, hits = [], [], 0
        while engine.has_unfinished_requests():
            for o in engine.step()[0]:
                out.append(o.token_ids)
                hits += o.num_cached_tokens if o.finished else 0
            steps.append(runner.last_logits.clone())
        logits[use is None], tokens[use is None], cached[use is None] = torch.cat(steps), out, hits
    ref = logits[True]
    torch.testing.assert_close(logits[False], ref, atol=2e-2 * ref.abs().max().item(), rtol=0)
    assert tokens[False] == tokens[True]
    assert cached[False] > 0 and any(scattered) and len(scattered) == 11  # every decode step ran natively


def test_float32_engine_keeps_its_exact_eager_decode(checkpoints):
    engine = O3Model.from_config(O3Config(model_path=checkpoints("llama-tied"), device="cpu", dtype="float32")).engine
    assert engine.runner.cpu_decode.native is None


@needs_kernels
def test_off_by_setting(checkpoints, tmp_path):
    path = str(tmp_path / "int8")
    build_engine_dir(checkpoints("llama-tied"), path, torch.bfloat16, None, preset="cpu-int8")
    engine = O3Model.from_config(O3Config(backend="torch", model_path=path, device="cpu", cpu_native_step=False)).engine
    assert engine.runner.cpu_decode.native is None
