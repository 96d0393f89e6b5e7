"""The full-precision engine against Hugging Face transformers, the oracle nobody here wrote."""

import pytest
import torch

from o3edge import O3Config, O3Model
from o3edge.engine.sequence import SamplingParams
from tests.conftest import VARIANTS
from tests.helpers import require

transformers = require("transformers")

PROMPTS = ["import os\nimport sys\n\ndef main(argv):\n", "class Queue:\n    \"\"\"A FIFO", "x = [", "#"]


def hf_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(checkpoints, variant):
    path = checkpoints(variant)
    engine = O3Model.from_config(O3Config(model_path=path, device="cpu", dtype="float32")).engine
    hf = hf_model(path)
    ids = engine.encode(PROMPTS[0] * 3)
    ours = engine.score(ids)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    assert ours.shape == theirs.shape
    # float32 rounding: both sides sum in a different order; logits here are O(1)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_identical_for_64_new_tokens(checkpoints, variant):
    path = checkpoints(variant)
    model = O3Model.from_config(O3Config(model_path=path, device="cpu", dtype="float32"))
    hf = hf_model(path)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    prompts = [model.engine.encode(p) for p in PROMPTS]
    # one at a time, then all together as one mixed-length batch
    alone = [model.generate_batch([ids], params)[0].token_ids for ids in prompts]
    together = [r.token_ids for r in model.generate_batch(prompts, params)]
    for ids, a, t in zip(prompts, alone, together):
        expected = hf_greedy(hf, ids, 64)
        assert a == expected
        assert t == expected


def test_decode_logits_match_transformers(checkpoints):
    """Logits computed step by step through the paged decode path equal the oracle's."""
    path = checkpoints("llama3-rope-untied")
    model = O3Model.from_config(O3Config(model_path=path, device="cpu", dtype="float32", kv_block_size=8))
    hf = hf_model(path)
    ids = model.engine.encode(PROMPTS[1])
    engine = model.engine
    engine.add_request("r", ids, SamplingParams(max_new_tokens=40, ignore_eos=True))
    step_logits = []
    while engine.has_unfinished_requests():
        engine.step()
        step_logits.append(engine.runner.last_logits[0].clone())
    full = ids + engine_tokens(step_logits)
    with torch.no_grad():
        theirs = hf(torch.tensor([full])).logits[0, len(ids) - 1:-1]
    torch.testing.assert_close(torch.stack(step_logits), theirs, atol=2e-5, rtol=1e-4)


def engine_tokens(step_logits):
    return [int(x.argmax()) for x in step_logits]
