import sys

import pytest

from o3edge.power.energy_log import EnergyLog
from o3edge.power.summary import plot_tokens_per_joule, read_log, summarise

HOUR = 1_800_000_000 // 3600 * 3600  # a whole hour, in unix seconds


def _record(ts, priority, completion, joules, low=False):
    return {"ts": ts, "request_id": f"r{ts}", "priority": priority, "prompt_tokens": 10,
            "completion_tokens": completion, "joules": joules, "tokens_per_joule": completion / joules,
            "meter": "nvml", "domains": ["gpu0"], "low_confidence": low}


RECORDS = [
    _record(HOUR + 10, "interactive", 100, 20.0),
    _record(HOUR + 20, "interactive", 50, 30.0, low=True),
    _record(HOUR + 30, "batch", 400, 40.0),
    _record(HOUR + 3600 + 5, "interactive", 60, 10.0),
]


def test_rows_per_hour_and_priority():
    rows = summarise(RECORDS)
    assert [(r.priority, r.requests) for r in rows] == [("batch", 1), ("interactive", 2), ("interactive", 1)]
    interactive = rows[1]
    assert interactive.hour.endswith(":00Z") and rows[2].hour > interactive.hour
    assert (interactive.prompt_tokens, interactive.completion_tokens, interactive.joules) == (20, 150, 50.0)
    assert interactive.tokens_per_joule == pytest.approx(3.0)
    assert interactive.low_confidence == 1 and interactive.meters == "nvml[gpu0]"


def test_summary_reads_rotated_logs_and_skips_bad_lines(tmp_path):
    path = tmp_path / "energy.jsonl"
    log = EnergyLog(path, max_bytes=600, backups=3)
    for record in RECORDS:
        log.write(record)
    with open(path, "a") as f:
        f.write("{not json\n")
    assert sorted(r["request_id"] for r in read_log(path, backups=3)) == sorted(r["request_id"] for r in RECORDS)
    assert sum(row.requests for row in summarise(path)) == len(RECORDS)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = plot_tokens_per_joule(RECORDS, tmp_path / "tpj.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_tokens_per_joule(RECORDS, tmp_path / "tpj.png")
