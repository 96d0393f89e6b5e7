import time

import pytest

from o3edge.power.composite_meter import CompositeMeter, auto_meter
from o3edge.power.estimate_meter import EstimateMeter
from o3edge.power.meter import MeterUnavailable
from o3edge.power.rapl_meter import RaplMeter


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_estimate_is_cpu_time_times_watts_and_labelled():
    meter = EstimateMeter(watts_per_core=20.0)
    assert meter.is_estimate and meter.domains == ("cpu-estimate",)
    _burn(0.2)
    joules = meter.read()[0].joules
    cpu_s = meter.cpu_seconds()
    assert 0.2 * 20.0 * 0.9 <= joules <= cpu_s * 20.0 + 1e-9
    assert "estimate" in meter.describe()


def test_auto_picks_jetson_alone(orin_sys):
    meter = auto_meter("auto", sys_root=orin_sys)
    assert meter.name == "jetson" and meter.domains == ("VDD_IN",) and not meter.is_estimate


def test_auto_falls_back_to_the_estimate_with_reasons(tmp_path):
    meter = auto_meter("auto", sys_root=tmp_path, nvml_devices=[])
    assert meter.name == "estimate" and meter.is_estimate
    assert {"jetson", "nvml", "rapl"} <= set(meter.skipped)


def test_named_preference_uses_only_that_meter(rapl_tree, orin_sys):
    meter = auto_meter("rapl", sys_root=orin_sys, rapl_root=rapl_tree.root)
    assert meter.name == "rapl" and meter.domains[0] == "cpu-package-0"


def test_strict_preference_raises_when_unreadable(tmp_path):
    with pytest.raises(MeterUnavailable):
        auto_meter("jetson", sys_root=tmp_path, strict=True)
    assert auto_meter("jetson", sys_root=tmp_path).is_estimate


def test_composite_sums_domains_and_refuses_overlap(rapl_tree):
    rapl = RaplMeter(rapl_tree.root)
    both = CompositeMeter([rapl, EstimateMeter()])
    assert both.name == "rapl+estimate" and both.is_estimate
    assert {r.domain for r in both.read()} == set(rapl.domains) | {"cpu-estimate"}
    with pytest.raises(ValueError, match="twice"):
        CompositeMeter([rapl, RaplMeter(rapl_tree.root)])
