"""The compiled CPU decode step ([engine] cpu_compile): same step as the eager one, no recompiles while serving."""

import pytest
import torch

from o3edge import O3Config, O3Model
from o3edge.engine.engine_dir import build_engine_dir
from o3edge.engine.sequence import SamplingParams


# one model (INT4 FFN, INT8 attention and LM head, q/k norms): each compile takes ~1-3 min on 2 cores
@pytest.mark.parametrize("variant,preset", [("qwen3-qknorm", "cpu-int4")])
def test_compiled_decode_matches_eager_and_never_recompiles(checkpoints, tmp_path, variant, preset):
    """Two sequences of different lengths decode together (spans of different ends, one graph for all batch
    sizes after warm-up); the logits of every step equal eager decode_forward's on the same INT8/INT4 layers."""
    from torch._dynamo.utils import counters

    path = str(tmp_path / preset)
    build_engine_dir(checkpoints(variant), path, torch.bfloat16, None, preset=preset)
    engine = O3Model.from_config(O3Config(model_path=path, device="cpu", kv_block_size=8, cpu_compile=True,
                                          cpu_native_step=False)).engine
    runner = engine.runner
    compiled = runner.cpu_decode.compiled
    assert compiled is not None and set(compiled.warmup_seconds) == {1, 2, 3}
    graphs = counters["stats"]["unique_graphs"]
    prompts = [engine.encode("def main():\n    return"), engine.encode("import os")]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    logits = {}
    for use in (compiled, None):
        runner.cpu_decode.compiled = use
        for i, ids in enumerate(prompts):
            engine.add_request(f"{use is None}{i}", ids, params)
        steps = []
        while engine.has_unfinished_requests():
            engine.step()
            steps.append(runner.last_logits.clone())
        logits[use is None] = torch.cat(steps)
    assert counters["stats"]["unique_graphs"] == graphs  # batch-2 steps reuse warm-up's graph
    ref = logits[True]
    torch.testing.assert_close(logits[False], ref, atol=2e-2 * ref.abs().max().item(), rtol=0)


def test_float32_engine_keeps_its_exact_eager_decode(checkpoints):
    engine = O3Model.from_config(O3Config(model_path=checkpoints("llama-tied"), device="cpu", dtype="float32",
                                          cpu_compile=True)).engine
    assert engine.runner.cpu_decode.compiled is None
