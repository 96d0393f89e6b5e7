"""Several meters read as one (GPU by NVML + CPU by RAPL), and the automatic choice of meters."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from o3edge.power.estimate_meter import DEFAULT_WATTS_PER_CORE, EstimateMeter
from o3edge.power.jetson_meter import JetsonMeter
from o3edge.power.meter import METER_CHOICES, Meter, MeterUnavailable, Reading
from o3edge.power.nvml_meter import NvmlMeter
from o3edge.power.rapl_meter import RaplMeter

log = logging.getLogger(__name__)

PREFERENCES = METER_CHOICES


class CompositeMeter(Meter):
    """The union of several meters' domains; its name joins theirs ("nvml+rapl").

    `skipped` maps each meter that was tried and left out to the reason, for `info`/`stats`.
    """

    def __init__(self, meters: Sequence[Meter], skipped: dict[str, str] | None = None):
        if not meters:
            raise ValueError("a composite meter needs at least one meter")
        domains = [d for m in meters for d in m.domains]
        duplicates = sorted({d for d in domains if domains.count(d) > 1})
        if duplicates:
            raise ValueError(f"meters share domain(s) {duplicates}: their energy would be counted twice")
        self.meters = tuple(meters)
        self.skipped = dict(skipped or {})
        self.name = "+".join(m.name for m in meters)
        self.is_estimate = any(m.is_estimate for m in meters)
        self.update_period_s = max(m.update_period_s for m in meters)

    @property
    def domains(self) -> tuple[str, ...]:
        """Every member meter's domains, in order."""
        return tuple(d for m in self.meters for d in m.domains)

    def read(self) -> list[Reading]:
        """Every member meter's readings."""
        return [r for m in self.meters for r in m.read()]

    def close(self) -> None:
        """Close every member meter."""
        for meter in self.meters:
            try:
                meter.close()
            except Exception as exc:
                log.warning("closing meter %s: %s", meter.name, exc)


def _try(kind: str, factory, skipped: dict[str, str]) -> Meter | None:
    try:
        return factory()
    except MeterUnavailable as exc:
        skipped[kind] = exc.message
        log.info("energy meter %s not available: %s", kind, exc.message)
        return None


def auto_meter(
    preference: str = "auto",
    *,
    sys_root: str | Path = "/sys",
    rapl_root: str | Path | None = None,
    nvml_devices: Sequence[int | str] | None = None,
    jetson_rails: Sequence[str] | None = None,
    watts_per_core: float = DEFAULT_WATTS_PER_CORE,
    strict: bool = False,
) -> CompositeMeter:
    """Pick readable meters: Jetson alone on a Jetson, else NVML (GPU) + RAPL (CPU), else the estimate.

    A named preference uses that meter only; if it is unreadable the estimate stands in (logged),
    or MeterUnavailable is raised when `strict`.
    """
    if preference not in PREFERENCES:
        raise ValueError(f"energy meter preference must be one of {PREFERENCES}, got {preference!r}")
    rapl_root = rapl_root if rapl_root is not None else Path(sys_root) / "class" / "powercap"
    factories = {
        "jetson": lambda: JetsonMeter(sys_root, rails=jetson_rails),
        "nvml": lambda: NvmlMeter(nvml_devices),
        "rapl": lambda: RaplMeter(rapl_root),
    }
    skipped: dict[str, str] = {}
    meters: list[Meter] = []
    if preference == "auto":
        jetson = _try("jetson", factories["jetson"], skipped)
        if jetson is not None:
            meters = [jetson]
        else:
            meters = [m for m in (_try(k, factories[k], skipped) for k in ("nvml", "rapl")) if m is not None]
    elif preference != "estimate":
        meter = _try(preference, factories[preference], skipped)
        if meter is None and strict:
            raise MeterUnavailable(f"energy meter {preference!r} is not available: {skipped[preference]}")
        meters = [meter] if meter is not None else []
    if not meters:
        if preference != "estimate":
            reasons = "; ".join(f"{k}: {v}" for k, v in skipped.items())
            log.warning("no energy meter readable (%s): using a CPU-time estimate", reasons)
        meters = [EstimateMeter(watts_per_core)]
    chosen = CompositeMeter(meters, skipped)
    log.info("energy meter: %s", chosen.describe())
    return chosen
