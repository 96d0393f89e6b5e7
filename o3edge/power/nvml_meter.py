"""GPU energy from NVML: the board's cumulative energy counter, or integrated power where it is missing."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

from o3edge.power.counters import CounterAccumulator, PowerIntegrator
from o3edge.power.meter import Meter, MeterUnavailable, Reading

log = logging.getLogger(__name__)

ENERGY_UPDATE_PERIOD_S = 0.1  # the energy counter advances in ~100 ms steps (seen on H200)
POWER_UPDATE_PERIOD_S = 1.0  # nvmlDeviceGetPowerUsage is a 1 s average on Ampere and newer


def _import_pynvml():
    """pynvml (from nvidia-ml-py), imported only when an NVML meter is asked for."""
    try:
        import pynvml
    except ImportError as exc:
        raise MeterUnavailable(f"pynvml is not installed (pip install nvidia-ml-py): {exc}") from None
    return pynvml


def visible_device_ids() -> list[int | str] | None:
    """GPUs named by CUDA_VISIBLE_DEVICES (indices or UUIDs), or None when it is unset or unusable."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None or value.strip() == "":
        return None
    ids: list[int | str] = []
    for item in value.split(","):
        item = item.strip()
        if item.isdigit():
            ids.append(int(item))
        elif item.startswith("GPU-"):
            ids.append(item)
        else:  # MIG-..., -1, or garbage: measure every board rather than guess
            log.info("CUDA_VISIBLE_DEVICES=%r not understood for NVML; measuring every GPU", value)
            return None
    return ids


class _Device:
    """One GPU and how its energy is tracked (counter or integrated power)."""

    def __init__(self, pynvml, handle, domain: str):
        self.handle = handle
        self.domain = domain
        self.counter: CounterAccumulator | None = None
        self.integrator: PowerIntegrator | None = None
        try:
            first = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            self.counter = CounterAccumulator(first, 1e-3, f"nvml:{domain}")
        except pynvml.NVMLError as exc:
            # Older than Volta, or not supported by this board: fall back to power readings.
            watts = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
            log.info("NVML energy counter unavailable on %s (%s): integrating power instead", domain, exc)
            self.integrator = PowerIntegrator(f"nvml:{domain}")
            self.integrator.update(time.monotonic_ns(), watts)

    def read(self, pynvml) -> Reading:
        """Cumulative joules of this device."""
        if self.counter is not None:
            raw = pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            t_ns = time.monotonic_ns()
            return Reading(t_ns, self.domain, self.counter.update(raw))
        watts = pynvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0
        t_ns = time.monotonic_ns()
        return Reading(t_ns, self.domain, self.integrator.update(t_ns, watts))


class NvmlMeter(Meter):
    """Whole-board GPU energy (other processes on the board included), one domain per GPU."""

    name = "nvml"

    def __init__(self, device_ids: Sequence[int | str] | None = None):
        self._pynvml = pynvml = _import_pynvml()
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError, or a missing libnvidia-ml.so
            raise MeterUnavailable(f"NVML could not start: {exc}") from None
        try:
            self._devices = self._open_devices(device_ids if device_ids is not None else visible_device_ids())
        except Exception:
            self._shutdown()
            raise
        by_power = [d.domain for d in self._devices if d.integrator is not None]
        self.update_period_s = POWER_UPDATE_PERIOD_S if by_power else ENERGY_UPDATE_PERIOD_S
        log.info("NVML meter on %s%s", ", ".join(self.domains), f" (power-integrated: {by_power})" if by_power else "")

    def _open_devices(self, device_ids: Sequence[int | str] | None) -> list[_Device]:
        pynvml = self._pynvml
        try:
            ids = list(device_ids) if device_ids is not None else list(range(pynvml.nvmlDeviceGetCount()))
        except pynvml.NVMLError as exc:
            raise MeterUnavailable(f"NVML could not count GPUs: {exc}") from None
        devices, reasons = [], []
        for dev_id in ids:
            try:
                if isinstance(dev_id, str):
                    handle = pynvml.nvmlDeviceGetHandleByUUID(dev_id)
                    domain = f"gpu{pynvml.nvmlDeviceGetIndex(handle)}"
                else:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(dev_id)
                    domain = f"gpu{dev_id}"
                devices.append(_Device(pynvml, handle, domain))
            except pynvml.NVMLError as exc:
                reasons.append(f"GPU {dev_id}: {exc}")
        for reason in reasons:
            log.warning("NVML meter skips %s", reason)
        if not devices:
            detail = f" ({'; '.join(reasons)})" if reasons else ""
            raise MeterUnavailable(f"NVML found no GPU whose energy or power it can read{detail}")
        return devices

    @property
    def domains(self) -> tuple[str, ...]:
        """One domain per GPU: "gpu0", "gpu1", ... (NVML indices)."""
        return tuple(d.domain for d in self._devices)

    def read(self) -> list[Reading]:
        """Cumulative joules per GPU since the meter started."""
        return [d.read(self._pynvml) for d in self._devices]

    def close(self) -> None:
        """Shut NVML down."""
        self._shutdown()

    def _shutdown(self) -> None:
        try:
            self._pynvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown: %s", exc)
