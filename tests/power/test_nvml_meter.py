import logging
import sys
import time
import types

import pytest

from o3edge.power.meter import MeterUnavailable
from o3edge.power.nvml_meter import NvmlMeter


class NVMLError(Exception):
    pass


def fake_pynvml(energy_mj=None, power_mw=None) -> types.ModuleType:
    """A stand-in for the third-party pynvml: one GPU whose counter/power follow the given lists."""
    mod = types.ModuleType("pynvml")
    mod.NVMLError = NVMLError
    mod.nvmlInit = lambda: None
    mod.nvmlShutdown = lambda: None
    mod.nvmlDeviceGetCount = lambda: 1
    mod.nvmlDeviceGetHandleByIndex = lambda i: f"handle{i}"

    def energy(handle):
        if energy_mj is None:
            raise NVMLError("Not Supported")
        return energy_mj.pop(0)

    mod.nvmlDeviceGetTotalEnergyConsumption = energy
    mod.nvmlDeviceGetPowerUsage = lambda handle: power_mw
    return mod


def test_energy_counter_and_negative_delta_rebaselines(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(energy_mj=[1_000, 5_000, 2_000, 3_000]))
    meter = NvmlMeter(device_ids=[0])
    assert meter.domains == ("gpu0",) and meter.update_period_s == pytest.approx(0.1)
    assert meter.read()[0].joules == pytest.approx(4.0)
    with caplog.at_level(logging.WARNING, logger="o3edge.power.counters"):
        assert meter.read()[0].joules == pytest.approx(4.0)  # driver reset: no energy, no negative energy
    assert "re-baselined" in caplog.text
    assert meter.read()[0].joules == pytest.approx(5.0)


def test_power_fallback_integrates_watts(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(power_mw=80_000))
    meter = NvmlMeter(device_ids=[0])
    assert meter.update_period_s == pytest.approx(1.0)  # a 1 s power average, not a 100 ms counter
    r0 = meter.read()[0]
    time.sleep(0.01)
    r1 = meter.read()[0]
    assert r1.joules - r0.joules == pytest.approx(80.0 * (r1.monotonic_ns - r0.monotonic_ns) / 1e9)


def test_missing_pynvml_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(MeterUnavailable, match="nvidia-ml-py"):
        NvmlMeter()


@pytest.mark.gpu
def test_real_gpu_joules_during_busy_loop():
    torch = pytest.importorskip("torch")
    pytest.importorskip("pynvml")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    meter = NvmlMeter()
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    before = {r.domain: r for r in meter.read()}
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        for _ in range(20):
            x = (x @ x).clamp_(-1, 1)
        torch.cuda.synchronize()
    after = {r.domain: r for r in meter.read()}
    joules = sum(after[d].joules - before[d].joules for d in after)
    seconds = (max(r.monotonic_ns for r in after.values()) - min(r.monotonic_ns for r in before.values())) / 1e9
    watts = joules / seconds
    logging.getLogger(__name__).info("NVML: %.1f J over %.2f s = %.0f W on %s", joules, seconds, watts, meter.domains)
    assert 30.0 < watts < 2000.0  # a busy board draws more than idle and less than any real limit
    meter.close()
