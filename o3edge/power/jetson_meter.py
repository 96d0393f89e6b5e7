"""Jetson module energy from the INA3221 power monitors (hwmon, or the older ina3221x iio layout)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from o3edge.power.counters import PowerIntegrator
from o3edge.power.meter import Meter, MeterUnavailable, Reading

log = logging.getLogger(__name__)

# Rails that measure the whole module's input on the Jetson generations we know of (Orin: VDD_IN;
# Nano/TX1: POM_5V_IN; Xavier NX: VDD_IN; AGX Xavier: the sum is not on one rail).
TOTAL_RAILS = ("VDD_IN", "POM_5V_IN", "VIN_SYS_5V0")


@dataclass
class Rail:
    """One INA3221 channel: its label and the files giving millivolts and milliamps."""

    label: str
    millivolts: Path
    milliamps: Path

    def watts(self) -> float:
        """Instantaneous power on this rail."""
        mv = float(self.millivolts.read_text().strip())
        ma = float(self.milliamps.read_text().strip())
        return mv * ma / 1e6


def _hwmon_rails(sys_root: Path) -> list[Rail]:
    rails = []
    for label_file in sorted(sys_root.glob("bus/i2c/drivers/ina3221/*/hwmon/hwmon*/in*_label")):
        channel = label_file.name[len("in"):-len("_label")]
        rails.append(Rail(label_file.read_text().strip(), label_file.parent / f"in{channel}_input",
                          label_file.parent / f"curr{channel}_input"))
    return rails


def _iio_rails(sys_root: Path) -> list[Rail]:
    rails = []
    for name_file in sorted(sys_root.glob("bus/i2c/drivers/ina3221x/*/iio:device*/rail_name_*")):
        channel = name_file.name[len("rail_name_"):]
        rails.append(Rail(name_file.read_text().strip(), name_file.parent / f"in_voltage{channel}_input",
                          name_file.parent / f"in_current{channel}_input"))
    return rails


def discover_rails(sys_root: str | Path = "/sys") -> dict[str, Rail]:
    """Every readable INA3221 rail by label; channels with no label or unreadable inputs are left out."""
    found: dict[str, Rail] = {}
    for rail in _hwmon_rails(Path(sys_root)) + _iio_rails(Path(sys_root)):
        if not rail.label or rail.label.upper() == "NC":
            continue
        try:
            rail.watts()
        except (OSError, ValueError) as exc:
            log.info("INA3221 rail %s left out: %s", rail.label, exc)
            continue
        label = rail.label if rail.label not in found else f"{rail.label}@{rail.millivolts.parent.name}"
        found[label] = rail
    return found


class JetsonMeter(Meter):
    """Module energy from INA3221 rails: VDD_IN alone when present (it is the total), else the rails asked for."""

    name = "jetson"
    update_period_s = 0.1  # nominal: power is sampled and integrated at the sampler's period

    def __init__(self, sys_root: str | Path = "/sys", rails: Sequence[str] | None = None):
        found = discover_rails(sys_root)
        if not found:
            raise MeterUnavailable(f"no readable INA3221 rails under {sys_root}/bus/i2c/drivers/ina3221*")
        self._rails = self._choose(found, rails)
        self._integrators = {label: PowerIntegrator(f"jetson:{label}") for label in self._rails}
        self.read()  # starts the integration: the first sample is the reference point
        log.info("Jetson meter on rails %s (found %s)", ", ".join(self.domains), ", ".join(found))

    @staticmethod
    def _choose(found: dict[str, Rail], wanted: Sequence[str] | None) -> dict[str, Rail]:
        if wanted:
            missing = [r for r in wanted if r not in found]
            if missing:
                raise MeterUnavailable(f"INA3221 rail(s) {missing} not found; present: {sorted(found)}")
            return {r: found[r] for r in wanted}
        for total in TOTAL_RAILS:
            if total in found:
                return {total: found[total]}
        log.warning("no whole-module rail (%s) among %s: summing them, which may miss some of the module",
                    "/".join(TOTAL_RAILS), sorted(found))
        return dict(found)

    @property
    def domains(self) -> tuple[str, ...]:
        """The rail labels measured, e.g. ("VDD_IN",)."""
        return tuple(self._rails)

    def read(self) -> list[Reading]:
        """Cumulative joules per rail, integrating V×I since the meter started."""
        readings = []
        for label, rail in self._rails.items():
            watts = rail.watts()
            t_ns = time.monotonic_ns()
            readings.append(Reading(t_ns, label, self._integrators[label].update(t_ns, watts)))
        return readings
