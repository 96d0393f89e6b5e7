import os

import pytest

from o3edge.power.meter import MeterUnavailable
from o3edge.power.rapl_meter import RaplMeter

from .conftest import RaplTree


def test_packages_and_dram_without_double_counting(rapl_tree):
    meter = RaplMeter(rapl_tree.root)
    # core/uncore are inside package-0 and the mmio zone duplicates it: none may be added
    assert meter.domains == ("cpu-package-0", "cpu-package-1", "cpu-dram-0")
    assert not meter.is_estimate


def test_cumulative_joules_per_zone(rapl_tree):
    meter = RaplMeter(rapl_tree.root)
    rapl_tree.set("intel-rapl:0", 1_000_000 + 2_500_000)
    rapl_tree.set("intel-rapl:0:2", 200_000 + 500_000)
    readings = {r.domain: r.joules for r in meter.read()}
    assert readings == pytest.approx({"cpu-package-0": 2.5, "cpu-package-1": 0.0, "cpu-dram-0": 0.5})
    rapl_tree.set("intel-rapl:1", 3_000_000 + 4_000_000)
    assert {r.domain: r.joules for r in meter.read()}["cpu-package-1"] == pytest.approx(4.0)


def test_wraparound_is_counted(tmp_path):
    tree = RaplTree(tmp_path / "powercap")
    tree.zone("intel-rapl:0", "package-0", energy_uj=9_000_000, max_uj=10_000_000)
    meter = RaplMeter(tree.root)
    tree.set("intel-rapl:0", 9_500_000)
    assert meter.read()[0].joules == pytest.approx(0.5)
    tree.set("intel-rapl:0", 1_000_000)  # wrapped: 0.5 J to the top, then 1 J
    assert meter.read()[0].joules == pytest.approx(2.0)
    tree.set("intel-rapl:0", 1_250_000)
    assert meter.read()[0].joules == pytest.approx(2.25)


def test_psys_used_only_without_packages(tmp_path):
    tree = RaplTree(tmp_path / "powercap")
    tree.zone("intel-rapl:1", "psys", 0)
    assert RaplMeter(tree.root).domains == ("platform-psys-1",)


def test_no_zones_is_unavailable(tmp_path):
    with pytest.raises(MeterUnavailable, match="no RAPL"):
        RaplMeter(tmp_path / "missing")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_counter_names_the_capability(rapl_tree):
    (rapl_tree.zones["intel-rapl:0"] / "energy_uj").chmod(0o000)
    with pytest.raises(MeterUnavailable, match="CAP_DAC_READ_SEARCH"):
        RaplMeter(rapl_tree.root)
