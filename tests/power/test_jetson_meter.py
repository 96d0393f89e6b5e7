import pytest

from o3edge.power.jetson_meter import JetsonMeter
from o3edge.power.meter import MeterUnavailable

from .conftest import add_rail, hwmon_dir, write


def _integrated(meter, watts_by_domain):
    """Read twice; the joules must be watts × the time between the meter's own timestamps."""
    first = {r.domain: r for r in meter.read()}
    second = {r.domain: r for r in meter.read()}
    for domain, watts in watts_by_domain.items():
        dt_s = (second[domain].monotonic_ns - first[domain].monotonic_ns) / 1e9
        assert second[domain].joules - first[domain].joules == pytest.approx(watts * dt_s, rel=1e-9)


def test_vdd_in_alone_is_the_module_total(orin_sys):
    meter = JetsonMeter(orin_sys)
    assert meter.domains == ("VDD_IN",)  # the other rails are inside it
    _integrated(meter, {"VDD_IN": 10.0})


def test_power_change_is_integrated_by_trapezoid(orin_sys):
    meter = JetsonMeter(orin_sys)
    r0 = meter.read()[0]
    write(hwmon_dir(orin_sys) / "curr1_input", 4000)  # 10 W -> 20 W
    r1 = meter.read()[0]
    dt_s = (r1.monotonic_ns - r0.monotonic_ns) / 1e9
    assert r1.joules - r0.joules == pytest.approx(15.0 * dt_s, rel=1e-9)


def test_missing_total_rail_sums_the_others(tmp_path):
    sys_root = tmp_path / "sys"
    hw = hwmon_dir(sys_root)
    add_rail(hw, 2, "VDD_CPU_GPU_CV", 5000, 600)
    add_rail(hw, 3, "VDD_SOC", 5000, 400)
    meter = JetsonMeter(sys_root)
    assert meter.domains == ("VDD_CPU_GPU_CV", "VDD_SOC")
    _integrated(meter, {"VDD_CPU_GPU_CV": 3.0, "VDD_SOC": 2.0})


def test_requested_rail_missing_is_unavailable(orin_sys):
    with pytest.raises(MeterUnavailable, match="VDD_GPU"):
        JetsonMeter(orin_sys, rails=["VDD_GPU"])


def test_rail_with_unreadable_input_is_left_out(orin_sys):
    (hwmon_dir(orin_sys) / "curr1_input").unlink()
    meter = JetsonMeter(orin_sys)
    assert meter.domains == ("VDD_CPU_GPU_CV", "VDD_SOC")


def test_older_ina3221x_layout(tmp_path):
    iio = tmp_path / "sys/bus/i2c/drivers/ina3221x/6-0040/iio:device0"
    for channel, (name, mv, ma) in enumerate([("VDD_IN", 5000, 1000), ("VDD_SYS_GPU", 5000, 200)]):
        write(iio / f"rail_name_{channel}", name)
        write(iio / f"in_voltage{channel}_input", mv)
        write(iio / f"in_current{channel}_input", ma)
    meter = JetsonMeter(tmp_path / "sys")
    assert meter.domains == ("VDD_IN",)
    _integrated(meter, {"VDD_IN": 5.0})


def test_no_ina3221_is_unavailable(tmp_path):
    with pytest.raises(MeterUnavailable, match="INA3221"):
        JetsonMeter(tmp_path)
