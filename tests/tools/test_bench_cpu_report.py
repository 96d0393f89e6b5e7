"""tools/bench_cpu_report.py: a bench_cpu_peers.sh run's per-process JSONs into one table, JSON and plot."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "bench_cpu_report.py")


def _run(system: str, decode: list[float], ttft: list[float], rss: float) -> dict:
    """One process's JSON as bench_llamacpp.py and bench_cpu_o3.py write it (the fields the report reads)."""
    stat = lambda xs: dict(median=sorted(xs)[len(xs) // 2], min=min(xs), max=max(xs))  # noqa: E731
    return dict(system=system, threads=2, peak_rss_mb=rss, loadavg_start=[0.5], loadavg_end=[0.7],
                summary=dict(decode_tps=stat(decode), ttft_ms=stat(ttft)))


def test_the_table_takes_the_median_of_pass_medians_and_ratios_to_q4_0(tmp_path):
    """Two passes of two systems: each cell is the median of the passes' medians with the whole range of runs,
    the ratios are to llama.cpp Q4_0's cells, and the JSON holds the same table."""
    runs = {"llama.cpp Q4_0": [([200, 210, 220], [140, 150, 160]), ([190, 200, 230], [130, 140, 170])],
            "o3edge cpu-int4": [([300, 310, 320], [90, 100, 110]), ([280, 300, 330], [80, 100, 120])]}
    for p in (1, 2):
        (tmp_path / f"pass{p}").mkdir()
        for name, passes in runs.items():
            decode, ttft = passes[p - 1]
            (tmp_path / f"pass{p}" / f"{name}.json").write_text(json.dumps(_run(name, decode, ttft, 236.0)))
    out = subprocess.run([sys.executable, TOOL, str(tmp_path), "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "| o3edge cpu-int4 | 100 [80–120] | 305.0 [280.0–330.0] | 236 | 1.49x | 0.69x | 1.00x |" in out.stdout
    table = json.loads((tmp_path / "r.json").read_text())["table"]
    assert table["llama.cpp Q4_0"]["decode_tps"] == [205.0, 190, 230]


def test_the_plot_draws_saved_runs(tmp_path):
    pytest.importorskip("matplotlib")
    saved = os.path.join(REPO, "docs", "results", "cpu-avx2-2026-12-04", "cpu-peers-avx2.json")
    png = tmp_path / "cpu.png"
    out = subprocess.run([sys.executable, TOOL, "--plot", str(png), f"{saved}:AVX2", f"{saved}:again"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
