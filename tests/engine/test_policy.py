"""O3Model serves by its config's policy (o3edge.policy), the same object o3edged loads from its settings."""

import pytest

from o3edge import O3Config, O3Model
from o3edge.engine.sequence import Priority, SamplingParams
from o3edge.errors import Busy, InvalidRequest
from o3edge.policy import ClassLimits, Policy, RequestLimits, SchedulerPolicy

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


def test_o3model_enforces_custom_class_limits_queue_bound_and_request_limits(tiny_dir):
    policy = Policy(classes=SchedulerPolicy(normal=ClassLimits(1000, 1, 10)), queue_max_requests=2,
                    requests=RequestLimits(max_new_tokens=8))
    model = O3Model.from_config(O3Config(model_path=tiny_dir, device="cpu", policy=policy))
    prompts = [model.engine.encode(text) for text in ("a = 1", "b = 2", "c = 3")]

    with pytest.raises(Busy, match="queue is full"):  # a third waiting request does not fit
        model.generate_batch(prompts, GREEDY)
    assert not model.engine.has_unfinished_requests()  # none of the refused batch was left behind

    engine = model.engine
    engine.add_request("n1", prompts[0], GREEDY)
    engine.add_request("n2", prompts[1], GREEDY)
    engine.add_request("h1", prompts[2], GREEDY, priority=Priority.HIGH)  # another class: its own limit
    while engine.has_unfinished_requests():
        _, report = engine.step()
        normal = [rid for rid in (report.tokens if report else {}) if rid.startswith("n")]
        assert len(normal) <= 1  # at most one `normal` sequence runs at a time

    with pytest.raises(InvalidRequest, match="max_new_tokens must be at most 8"):
        model.generate("x = 1", max_new_tokens=9)
    assert len(model.generate("x = 1", max_new_tokens=8).token_ids) <= 8


def test_o3model_queue_bounds_waiting_prompt_tokens(tiny_dir):
    model = O3Model.from_config(O3Config(model_path=tiny_dir, device="cpu",
                                         policy=Policy(queue_max_requests=1, queue_max_prompt_tokens=10)))
    with pytest.raises(Busy, match="10 prompt tokens"):
        model.engine.add_request("long", list(range(11)), GREEDY)
