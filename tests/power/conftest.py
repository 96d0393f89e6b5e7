"""Fixture sysfs trees (RAPL, Jetson INA3221) in temporary directories, and a scripted meter."""

from __future__ import annotations

from pathlib import Path

import pytest

from o3edge.power.meter import Meter, Reading

MAX_RANGE_UJ = 262_143_328_850


def write(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{value}\n")


class RaplTree:
    """/sys/class/powercap as files: zones keyed by directory name, energy set by the test."""

    def __init__(self, root: Path):
        self.root = root
        self.zones: dict[str, Path] = {}

    def zone(self, name: str, label: str, energy_uj: int = 0, max_uj: int = MAX_RANGE_UJ, parent: str | None = None):
        path = (self.zones[parent] if parent else self.root) / name
        write(path / "name", label)
        write(path / "energy_uj", energy_uj)
        write(path / "max_energy_range_uj", max_uj)
        self.zones[name] = path
        return path

    def set(self, name: str, energy_uj: int) -> None:
        write(self.zones[name] / "energy_uj", energy_uj)


@pytest.fixture
def rapl_tree(tmp_path) -> RaplTree:
    """Two packages, core/uncore/dram subzones of package 0, and an mmio duplicate to be ignored."""
    tree = RaplTree(tmp_path / "powercap")
    tree.zone("intel-rapl:0", "package-0", 1_000_000)
    tree.zone("intel-rapl:0:0", "core", 500_000, parent="intel-rapl:0")
    tree.zone("intel-rapl:0:1", "uncore", 100_000, parent="intel-rapl:0")
    tree.zone("intel-rapl:0:2", "dram", 200_000, parent="intel-rapl:0")
    tree.zone("intel-rapl:1", "package-1", 3_000_000)
    tree.zone("intel-rapl-mmio:0", "package-0", 7_000_000)
    return tree


def hwmon_dir(sys_root: Path, device: str = "1-0040", hwmon: str = "hwmon3") -> Path:
    return sys_root / "bus/i2c/drivers/ina3221" / device / "hwmon" / hwmon


def add_rail(hwmon: Path, channel: int, label: str, millivolts: float, milliamps: float) -> None:
    write(hwmon / f"in{channel}_label", label)
    write(hwmon / f"in{channel}_input", millivolts)
    write(hwmon / f"curr{channel}_input", milliamps)


@pytest.fixture
def orin_sys(tmp_path) -> Path:
    """An Orin-like /sys: VDD_IN 5 V × 2 A = 10 W, VDD_CPU_GPU_CV 3 W, VDD_SOC 2 W."""
    sys_root = tmp_path / "sys"
    hw = hwmon_dir(sys_root)
    add_rail(hw, 1, "VDD_IN", 5000, 2000)
    add_rail(hw, 2, "VDD_CPU_GPU_CV", 5000, 600)
    add_rail(hw, 3, "VDD_SOC", 5000, 400)
    write(hw / "in4_input", 12)  # shunt channel without a label: not a rail
    return sys_root


class ScriptedMeter(Meter):
    """A meter for sampler/accountant tests: the test records readings; read() returns the last ones."""

    name = "scripted"

    def __init__(self, domains=("dev0",), update_period_s: float = 0.01, is_estimate: bool = False):
        self._domains = tuple(domains)
        self.update_period_s = update_period_s
        self.is_estimate = is_estimate
        self.next: list[Reading] = []
        self.fail = False

    @property
    def domains(self):
        return self._domains

    def read(self):
        if self.fail:
            raise OSError("scripted failure")
        return list(self.next)


def constant_power(domains, watts: float, t0_ns: int, t1_ns: int, step_ns: int = 10_000_000) -> list[Reading]:
    """Readings every step_ns from t0 to t1 (inclusive) of `watts` per domain, cumulative from t0."""
    out = []
    for t in range(t0_ns, t1_ns + 1, step_ns):
        out += [Reading(t, d, watts * (t - t0_ns) / 1e9) for d in domains]
    return out
