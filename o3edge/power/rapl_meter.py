"""CPU energy from Intel/AMD RAPL counters under /sys/class/powercap (package and DRAM zones)."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

from o3edge.power.counters import CounterAccumulator
from o3edge.power.meter import Meter, MeterUnavailable, Reading

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/sys/class/powercap"
_TOP = re.compile(r"^intel-rapl:(\d+)$")
_SUB = re.compile(r"^intel-rapl:(\d+):(\d+)$")
PERMISSION_HINT = (
    "energy_uj is readable by root only since CVE-2020-8694; grant the service CAP_DAC_READ_SEARCH "
    "(AmbientCapabilities=CAP_DAC_READ_SEARCH) rather than chmod the files"
)


@dataclass
class _Zone:
    path: Path
    domain: str
    counter: CounterAccumulator | None = None


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


def _zone_kind(name: str) -> str:
    """'package-0' -> 'package'; 'dram', 'core', 'uncore', 'psys' stay as they are."""
    return name.split("-")[0]


def discover_zones(root: str | Path = DEFAULT_ROOT) -> list[tuple[Path, str]]:
    """Non-overlapping RAPL zones as (directory, domain): packages, DRAM, or psys when alone.

    core/uncore subzones are inside their package and psys covers the packages, so neither is
    added to them: summing the domains must not count a joule twice.
    """
    root = Path(root)
    packages, drams, psys = [], [], []
    for top in sorted(root.glob("intel-rapl:*")):
        match = _TOP.match(top.name)
        if not match or not (top / "name").exists():
            continue
        index = match.group(1)
        kind = _zone_kind((top / "name").read_text().strip())
        if kind == "package":
            packages.append((top, f"cpu-package-{index}"))
        elif kind == "dram":
            drams.append((top, f"cpu-dram-{index}"))
        elif kind == "psys":
            psys.append((top, f"platform-psys-{index}"))
        for sub in sorted(top.glob(f"intel-rapl:{index}:*")):
            if _SUB.match(sub.name) and (sub / "name").exists():
                if _zone_kind((sub / "name").read_text().strip()) == "dram":
                    drams.append((sub, f"cpu-dram-{index}"))
    if packages:
        return packages + drams
    return psys


class RaplMeter(Meter):
    """CPU package (and DRAM where exposed) energy, one domain per zone, wraparound counted."""

    name = "rapl"
    update_period_s = 0.001  # RAPL updates about every millisecond; the sampler sets the real resolution

    def __init__(self, root: str | Path = DEFAULT_ROOT):
        self.root = Path(root)
        found = discover_zones(self.root)
        if not found:
            raise MeterUnavailable(f"no RAPL package zones under {self.root}")
        self._zones = [self._open(path, domain) for path, domain in found]
        log.info("RAPL meter on %s", ", ".join(self.domains))

    def _open(self, path: Path, domain: str) -> _Zone:
        try:
            first = _read_int(path / "energy_uj")
        except PermissionError:
            raise MeterUnavailable(f"cannot read {path / 'energy_uj'}: {PERMISSION_HINT}") from None
        except (OSError, ValueError) as exc:
            raise MeterUnavailable(f"cannot read {path / 'energy_uj'}: {exc}") from None
        try:
            wrap = _read_int(path / "max_energy_range_uj")
        except (OSError, ValueError) as exc:
            log.warning("%s has no readable max_energy_range_uj (%s): a wrap will read as a reset", path, exc)
            wrap = None
        return _Zone(path, domain, CounterAccumulator(first, 1e-6, f"rapl:{domain}", wrap_range=wrap))

    @property
    def domains(self) -> tuple[str, ...]:
        """Domains such as "cpu-package-0" and "cpu-dram-0"."""
        return tuple(z.domain for z in self._zones)

    def read(self) -> list[Reading]:
        """Cumulative joules per zone since the meter started (poll well inside one wrap period)."""
        readings = []
        for zone in self._zones:
            raw = _read_int(zone.path / "energy_uj")
            readings.append(Reading(time.monotonic_ns(), zone.domain, zone.counter.update(raw)))
        return readings
