import threading
import time
from types import SimpleNamespace

import pytest

from o3edge.power.accountant import EnergyAccountant
from o3edge.power.records import StepTokens
from o3edge.power.sampler import EnergySampler

from .conftest import ScriptedMeter, constant_power

S = 1_000_000_000
T0 = 1000 * S  # synthetic monotonic times; the accountant's clock is injected


class Clock:
    def __init__(self, now_ns: int):
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns


def _setup(until_s: float, watts: float = 100.0, now_s: float = 100.0, **kwargs):
    """A 100 W meter sampled every 10 ms from T0 to T0 + until_s, and an accountant started at T0."""
    sampler = EnergySampler(ScriptedMeter(("dev0",)), period_s=0.01)
    sampler.record(constant_power(("dev0",), watts, T0, T0 + int(until_s * S)))
    clock = Clock(T0 + int(now_s * S))
    return sampler, EnergyAccountant(sampler, clock=clock, start_ns=T0, **kwargs), clock


def _at(t0_s: float, t1_s: float, tokens) -> StepTokens:
    return StepTokens(T0 + int(t0_s * S), T0 + int(t1_s * S), tokens)


def test_step_energy_split_by_decode_tokens():
    _, acc, _ = _setup(3.0)
    acc.report_step(_at(1.0, 1.5, {"a": (0, 1), "b": (0, 3)}))
    a, b = acc.finish("a"), acc.finish("b")
    assert a.joules == pytest.approx(12.5, rel=0.01) and b.joules == pytest.approx(37.5, rel=0.01)
    assert (a.tokens, b.tokens) == (1, 3)
    assert b.tokens_per_joule == pytest.approx(3 / 37.5, rel=0.01)
    assert a.meter == "scripted" and a.domains == ("dev0",) and not a.low_confidence


def test_prefill_tokens_weigh_prefill_weight():
    _, acc, _ = _setup(3.0, prefill_weight=0.1)
    acc.report_step(_at(1.0, 1.5, {"long-prompt": (100, 0), "decoding": (0, 1)}))
    # weights 100 × 0.1 = 10 against 1: the 50 J step splits 10/11 and 1/11
    assert acc.finish("long-prompt").joules == pytest.approx(50 * 10 / 11, rel=0.01)
    decoding = acc.finish("decoding")
    assert decoding.joules == pytest.approx(50 / 11, rel=0.01) and decoding.prompt_tokens == 0


def test_requests_accumulate_over_steps_and_any_object_with_the_fields_works():
    _, acc, _ = _setup(3.0)
    acc.report_step(_at(0.5, 1.0, {"a": (20, 0)}))
    acc.report_step(SimpleNamespace(t_start_ns=T0 + S, t_end_ns=T0 + 2 * S, tokens={"a": (0, 4), "b": (0, 4)}))
    a = acc.finish("a")
    assert a.joules == pytest.approx(50 + 50, rel=0.01) and (a.prompt_tokens, a.tokens) == (20, 4)
    assert a.duration_s == pytest.approx(1.5)


def test_idle_energy_is_kept_apart():
    _, acc, _ = _setup(3.0)
    acc.report_step(_at(1.0, 1.5, {"a": (0, 4)}))
    acc.report_step(_at(2.0, 2.5, {"a": (0, 4)}))
    acc.settle()
    totals = acc.totals()
    assert totals.active_joules == pytest.approx(100.0, rel=0.01)
    assert totals.idle_joules == pytest.approx(200.0, rel=0.01)  # 0-1, 1.5-2 and 2.5-3 s
    assert totals.active_tokens_per_joule == pytest.approx(8 / 100, rel=0.01)
    assert totals.tokens_per_joule == pytest.approx(8 / 300, rel=0.01)
    assert acc.finish("a").joules == pytest.approx(100.0, rel=0.01)


def test_late_long_step_takes_its_time_back_from_idle():
    _, acc, _ = _setup(3.0)
    acc.settle()
    assert acc.totals().idle_joules == pytest.approx(300.0, rel=0.01)
    acc.report_step(_at(2.0, 2.9, {"a": (0, 9)}))  # reported after its time was counted as idle
    totals = acc.totals()
    assert totals.active_joules == pytest.approx(90.0, rel=0.01)
    assert totals.idle_joules == pytest.approx(210.0, rel=0.01)


def test_steps_wait_for_the_sampler_then_settle():
    sampler, acc, clock = _setup(1.0, now_s=1.3)
    acc.report_step(_at(1.1, 1.2, {"a": (0, 1), "b": (0, 1)}))
    acc.settle()
    assert acc.num_pending_steps == 1  # the sampler has not read past its end yet
    sampler.record(constant_power(("dev0",), 100.0, T0, T0 + 2 * S))
    acc.settle()
    assert acc.num_pending_steps == 0
    assert acc.finish("a").joules == pytest.approx(5.0, rel=0.01)


def test_finish_before_settling_extrapolates_and_does_not_double_count():
    sampler, acc, _ = _setup(1.0, now_s=1.3)
    acc.report_step(_at(0.2, 0.8, {"a": (0, 2)}))
    acc.report_step(_at(1.1, 1.2, {"a": (0, 1), "b": (0, 1)}))
    a = acc.finish("a")  # last step not sampled yet: its share is extrapolated at the recent 100 W
    assert a.joules == pytest.approx(60 + 5, rel=0.01)
    assert a.low_confidence  # 0.1 s past the last sample is more than one resolution (10 ms)
    sampler.record(constant_power(("dev0",), 100.0, T0, T0 + 2 * S))
    acc.settle()
    assert acc.finish("b").joules == pytest.approx(5.0, rel=0.01)
    assert acc.totals().active_joules == pytest.approx(70.0, rel=0.01)
    assert acc.finish("a").joules == 0 and acc.finish("a").low_confidence  # not resurrected


def test_finish_waits_for_the_sampler():
    sampler, acc, _ = _setup(1.0, now_s=1.3)
    acc.report_step(_at(1.1, 1.2, {"a": (0, 1)}))

    def sample_later():
        time.sleep(0.05)
        sampler.record(constant_power(("dev0",), 100.0, T0, T0 + 2 * S))
        acc.settle()

    threading.Thread(target=sample_later).start()
    a = acc.finish("a", wait_s=2.0)
    assert a.joules == pytest.approx(10.0, rel=0.01) and not a.low_confidence


def test_short_request_is_low_confidence():
    _, acc, _ = _setup(3.0)
    acc.report_step(_at(1.0, 1.005, {"a": (0, 1)}))
    assert acc.finish("a").low_confidence  # 5 ms < 2 resolutions of 10 ms


def test_malformed_reports_are_ignored_without_raising():
    _, acc, _ = _setup(3.0)
    acc.report_step(object())
    acc.report_step(_at(2.0, 1.0, {"a": (0, 1)}))
    acc.report_step(_at(1.0, 2.0, {"a": (-1, 1)}))
    assert acc.num_pending_steps == 0
    unknown = acc.finish("nobody")
    assert unknown.joules == 0 and unknown.tokens_per_joule is None and unknown.low_confidence


def test_recent_window_totals():
    sampler, acc, clock = _setup(200.0, now_s=201.0)
    acc.report_step(_at(10.0, 20.0, {"old": (0, 100)}))
    acc.report_step(_at(180.0, 190.0, {"new": (0, 50)}))
    recent, overall = acc.totals(window_s=60), acc.totals()
    assert recent.tokens == 50 and recent.active_joules == pytest.approx(1000.0, rel=0.01)
    assert recent.active_tokens_per_joule == pytest.approx(0.05, rel=0.01)
    assert recent.idle_joules == pytest.approx(4900.0, rel=0.01)  # 141-180 s and 190-200 s, not 20-180 s
    assert overall.tokens == 150 and overall.active_joules == pytest.approx(2000.0, rel=0.01)
    assert overall.tokens_per_joule == pytest.approx(150 / 20000, rel=0.01)  # 200 s at 100 W in all


def test_engine_thread_calls_never_wait_on_settling():
    """report_step and finish (no wait) complete while a settle or a `stats` total holds the settling lock."""
    _, acc, _ = _setup(3.0)
    acc.report_step(_at(1.0, 1.5, {"a": (0, 1), "b": (0, 1)}))
    done, result = threading.Event(), {}

    def engine_thread():
        acc.report_step(_at(1.5, 2.0, {"a": (0, 1)}))
        result["a"] = acc.finish("a")
        done.set()

    with acc._cond:  # what the sampler thread holds while it settles, and `stats` while it totals
        threading.Thread(target=engine_thread, daemon=True).start()
        assert done.wait(5.0), "the engine thread waited on the settling lock"
    assert result["a"].joules == pytest.approx(25.0 + 50.0, rel=0.01)  # half of 0.5 s at 100 W, then all of 0.5 s
    totals = acc.totals()  # the steps settle afterwards for the totals, each once, not again for "a"
    assert totals.active_joules == pytest.approx(100.0, rel=0.01) and totals.tokens == 3
    assert acc.finish("b").joules == pytest.approx(25.0, rel=0.01) and acc.finish("a").joules == 0
