"""tools/bench_demotions.py: a refresh's demotions (books, then the data's flush) timed on their own."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_planned_demotion_is_carried_out_and_timed(tmp_path):
    """The tool asserts each run demoted exactly what it planned and flushed every move; the JSON has a
    time for the books and for the flush (on this machine the flush is torch's: no CUDA)."""
    out_json = tmp_path / "demotions.json"
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_demotions.py"), "--device", "cpu",
                          "--dtype", "float32", "--batch", "3", "--context", "320", "--demotions", "12",
                          "--repeat", "2", "--json", str(out_json)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out_json.read_text())
    assert result["demotions"] == 12 and result["flush"] == "torch operations"
    times = result["median_ms"]
    assert 0 < times["books"] and 0 < times["flush host"] <= times["flush total"]
