"""o3edge-cli energy: the log summarised per hour and priority class, as text and JSON, and the PNG plot."""

import json

import pytest

from o3edge import cli
from o3edge.power.energy_log import EnergyLog

HOUR = 1_800_000_000 // 3600 * 3600  # a whole hour, in unix seconds


def _record(ts, priority, completion, joules, low=False):
    return {"ts": ts, "request_id": f"r{ts}", "priority": priority, "prompt_tokens": 10,
            "completion_tokens": completion, "joules": joules, "tokens_per_joule": completion / joules,
            "meter": "estimate", "domains": ["cpu-estimate"], "is_estimate": True, "low_confidence": low,
            "finish_reason": "length"}


@pytest.fixture
def energy_log(tmp_path):
    """A rotated log: two hours, two classes; 'high' in the first hour makes 300 tokens from 30 J."""
    path = tmp_path / "energy.jsonl"
    log = EnergyLog(path, max_bytes=700, backups=3)
    for record in (_record(HOUR + 10, "high", 100, 10.0), _record(HOUR + 20, "high", 200, 20.0, low=True),
                   _record(HOUR + 30, "low", 400, 100.0), _record(HOUR + 3605, "high", 60, 30.0)):
        log.write(record)
    assert (tmp_path / "energy.jsonl.1").exists()  # the summary must read the backups too
    return path


def run(capsys, *args):
    status = cli.main(["energy", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_per_hour_and_class_rows_with_a_total(capsys, energy_log):
    status, out, _ = run(capsys, "--log", str(energy_log))
    assert status == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["hour", "priority", "requests"]
    rows = [line.split() for line in lines[1:-1]]
    assert [(r[1], r[2]) for r in rows] == [("high", "2"), ("low", "1"), ("high", "1")]
    assert rows[0][6] == "10.000" and rows[0][7] == "1" and rows[0][8] == "estimate[cpu-estimate]"
    assert lines[-1] == "total: 4 requests, 760 generated tokens, 160.000 J, 4.750 tokens/J"


def test_json_by_priority_and_by_hour(capsys, energy_log):
    status, out, _ = run(capsys, "--log", str(energy_log), "--by", "priority", "--json")
    assert status == 0
    rows = {r["priority"]: r for r in json.loads(out)}
    assert set(rows) == {"high", "low"} and rows["high"]["hour"] == "*"
    assert (rows["high"]["requests"], rows["high"]["completion_tokens"]) == (3, 360)
    assert rows["high"]["tokens_per_joule"] == pytest.approx(360 / 60)
    status, out, _ = run(capsys, "--log", str(energy_log), "--by", "hour", "--json")
    by_hour = json.loads(out)
    assert [r["requests"] for r in by_hour] == [3, 1] and by_hour[0]["tokens_per_joule"] == pytest.approx(700 / 130)


def test_plot_is_a_valid_png(capsys, energy_log, tmp_path):
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "tpj.png"
    status, _, err = run(capsys, "--log", str(energy_log), "--plot", str(out_png))
    assert status == 0 and str(out_png) in err
    data = out_png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1000, 450)


def test_a_missing_log_is_one_clear_line(capsys, tmp_path):
    status, out, err = run(capsys, "--log", str(tmp_path / "none.jsonl"))
    assert status == cli.EXIT_REQUEST and out == ""
    missing = tmp_path / "none.jsonl"
    assert err.strip() == f"o3edge-cli: no energy log at {missing} (set [power] energy_log or pass --log)"


def test_the_default_log_follows_the_settings(monkeypatch, tmp_path):
    from o3edge.energy_service import default_energy_log

    monkeypatch.setattr("o3edge.settings.DEFAULT_CONFIG_PATH", str(tmp_path / "absent.toml"))
    monkeypatch.setenv("O3EDGE_POWER_ENERGY_LOG", str(tmp_path / "configured.jsonl"))
    assert default_energy_log() == tmp_path / "configured.jsonl"
    monkeypatch.delenv("O3EDGE_POWER_ENERGY_LOG")
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path))
    assert default_energy_log() == tmp_path / "energy.jsonl"


def test_stats_energy_line_names_meter_and_windows():
    figures = {"tokens_per_joule": 2.5, "active_tokens_per_joule": 4.0}
    line = cli.energy_line({"meter": "nvml+rapl", "domains": ["gpu0", "cpu-package-0"], "is_estimate": False,
                            "all": figures, "last_60s": figures, "last_900s": {"tokens_per_joule": None}})
    assert line == ("tokens/J: all time 4 active / 2.5 with idle; last 60s 4 active / 2.5 with idle; "
                    "last 900s - active / - with idle — nvml+rapl [gpu0,cpu-package-0], measured")
