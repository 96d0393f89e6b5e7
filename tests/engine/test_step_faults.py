"""A request that fails inside a step ends alone: the others in that step finish with the same tokens."""

import torch

from o3edge import O3Config, O3Model
from o3edge.engine.faults import is_fatal
from o3edge.engine.sequence import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
PROMPTS = ("def f(x):", "import os", "for i in range(3):")


def run(engine, prompts):
    """Step until idle; each request's tokens, finish reason and error."""
    out = {}
    for rid, text in prompts.items():
        engine.add_request(rid, engine.encode(text), GREEDY)
        out[rid] = {"tokens": [], "reason": None, "error": None}
    while engine.has_unfinished_requests():
        outputs, report = engine.step()
        for o in outputs:
            out[o.request_id]["tokens"] += o.token_ids
            if o.finished:
                out[o.request_id].update(reason=o.finish_reason, error=o.error)
    return out


def test_a_failing_request_ends_alone_and_the_others_finish_unchanged(tiny_dir):
    engine = O3Model.from_config(O3Config(model_path=tiny_dir, device="cpu")).engine
    clean = run(engine, {f"ok{i}": p for i, p in enumerate(PROMPTS)})
    steps = []

    def fault(seq):  # the bad request fails at its third token, in a step it shares with the others
        if seq.request_id == "bad" and seq.num_output_tokens == 2:
            steps.append({s.request_id for s in engine.scheduler.running})
            raise ValueError("injected failure of one request")

    engine.fault_hook = fault
    mixed = run(engine, {"bad": "x = [1, 2", **{f"again{i}": p for i, p in enumerate(PROMPTS)}})
    assert steps and {"again0", "again1", "again2"} <= steps[0]  # the others were in that very step
    assert mixed["bad"]["reason"] == "error" and "injected failure" in mixed["bad"]["error"]
    assert len(mixed["bad"]["tokens"]) == 2
    for i in range(len(PROMPTS)):
        assert mixed[f"again{i}"] == {**clean[f"ok{i}"], "error": None}
    assert engine.num_failed_steps == 0 and "bad" not in engine.seqs
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # the failed request freed its blocks


def test_device_loss_is_fatal_and_out_of_memory_is_not():
    assert is_fatal(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert is_fatal(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_fatal(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_fatal(ValueError("a bug in one request's sampling"))


