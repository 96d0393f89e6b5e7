import logging
import time

import pytest

from o3edge.power.meter import Reading
from o3edge.power.rapl_meter import RaplMeter
from o3edge.power.sampler import EnergySampler

from .conftest import ScriptedMeter

MS = 1_000_000


def _sampler(readings, period_s=0.01):
    sampler = EnergySampler(ScriptedMeter(("a", "b")), period_s=period_s)
    sampler.record(readings)
    return sampler


def test_linear_interpolation_between_samples():
    readings = [Reading(t * MS, "a", j) for t, j in ((0, 0.0), (100, 10.0), (200, 30.0), (300, 31.0))]
    readings += [Reading(t * MS + 3 * MS, "b", j) for t, j in ((0, 0.0), (300, 3.0))]  # later stamps, other rate
    window = _sampler(readings).energy_between(50 * MS, 150 * MS)
    # a: 5 J from the first segment's half + 10 J from the second's; b: 1 J per 100 ms
    assert window.by_domain["a"] == pytest.approx(15.0)
    assert window.by_domain["b"] == pytest.approx(1.0)
    assert window.joules == pytest.approx(16.0)
    assert window.domains == ("a", "b") and not window.low_confidence


def test_short_window_is_low_confidence():
    sampler = _sampler([Reading(t * MS, d, t / 100) for t in range(0, 1001, 10) for d in "ab"], period_s=0.1)
    assert sampler.energy_between(100 * MS, 250 * MS).low_confidence  # 150 ms < 2 × 100 ms
    assert not sampler.energy_between(100 * MS, 400 * MS).low_confidence


def test_outside_the_timeline_is_low_confidence_and_clamped():
    sampler = _sampler([Reading(t * MS, d, t / 10) for t in range(1000, 2001, 10) for d in "ab"])
    before = sampler.energy_between(0, 1500 * MS)
    assert before.low_confidence and before.joules == pytest.approx(2 * 50.0)  # nothing counted before the first sample
    after = sampler.energy_between(1500 * MS, 2500 * MS)  # extrapolated at the recent power
    assert after.low_confidence and after.joules == pytest.approx(2 * 100.0)


def test_history_is_bounded():
    sampler = EnergySampler(ScriptedMeter(("a",)), period_s=0.01, history_s=1.0)
    sampler.record(Reading(t * 10 * MS, "a", float(t)) for t in range(10_000))
    assert len(sampler.timeline._series["a"].ts) <= 2 * 101 + 1
    assert sampler.covered_until_ns() == 9_999 * 10 * MS


def test_thread_samples_a_real_meter_and_stops(rapl_tree):
    sampler = EnergySampler(RaplMeter(rapl_tree.root), period_s=0.01)
    calls = []
    sampler.add_listener(lambda: calls.append(1))
    assert sampler.start()
    time.sleep(0.15)
    sampler.stop()
    assert not sampler.is_running
    assert len(sampler.timeline._series["cpu-package-0"].ts) >= 5 and len(calls) >= 5


def test_failing_meter_never_raises_and_logs_once(caplog):
    meter = ScriptedMeter(("a",))
    meter.fail = True
    sampler = EnergySampler(meter, period_s=0.005)
    sampler.add_listener(lambda: 1 / 0)  # a broken listener must not kill the thread either
    with caplog.at_level(logging.WARNING, logger="o3edge.power.sampler"):
        with sampler:
            time.sleep(0.1)
            assert sampler.is_running
    assert caplog.text.count("read failed") == 1
    assert sampler.covered_until_ns() is None
