"""tools/bench_host_step.py: the engine's host path on the graph decode path with the device stubbed."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("setting", ["off", "router-int8"])
def test_every_decode_step_after_the_first_is_taken_from_the_launch_ahead_queue(setting, tmp_path):
    """With the forward stubbed, the decode runs the host's real path: every decode step but the first
    launched ahead (the router's demotions at its first routing included), and timed."""
    out_json = tmp_path / "host.json"
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_host_step.py"), "--setting", setting,
                          "--batch", "2", "--context", "96", "--steps", "12", "--repeat", "1", "--refresh-steps", "4",
                          "--json", str(out_json)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    run = json.loads(out_json.read_text())["runs"][0]
    assert run["steps"] >= 10  # 12 new tokens: the first with each prompt (the second may share its step)
    assert run["launched_ahead"] >= run["steps"] - 1
    assert 0 < run["median_ms"] <= run["p90_ms"]
    kinds = run["by_kind"]  # the router's refresh steps (one in 4 here) and the steps after them
    assert sum(k["n"] for k in kinds.values()) == run["steps"]
    assert set(kinds) == ({"other", "refresh", "after refresh"} if setting != "off" else {"other"})


def test_stubbed_attention_makes_the_router_compress_prompts_and_demote_at_refreshes(tmp_path):
    """The stubs' observed attention is what routing works from: some of each prompt compressed when it ends, then
    demotions at the decode refreshes, carried out by the host (a stand-in for the device's moves), with each
    refresh cycle's host work above ordinary steps reported; with --parts, each kind of step's time by host
    function: the books' demotions only in the demoting step, the metadata in every kind."""
    out_json = tmp_path / "host.json"
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_host_step.py"), "--setting", "router-int8",
                          "--batch", "2", "--context", "960", "--steps", "40", "--repeat", "1", "--refresh-steps", "8",
                          "--clock", "thread", "--parts", "--json", str(out_json)], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    run = json.loads(out_json.read_text())["runs"][0]
    assert 0.05 < run["compressed_after_prompts"] < 0.95
    assert run["demoted_per_refresh"] > 0 and "demoting" in run["by_kind"]
    assert run["cycle_extra_ms"] > 0
    parts = run["parts_by_kind"]
    assert set(parts) == set(run["by_kind"])
    assert parts["demoting"]["RouterBlocks.carry_out"] > 0 and parts["other"].get("RouterBlocks.carry_out", 0) == 0
    assert all(p["RouterDecodeGraphs.fill_meta"] > 0 for p in parts.values())
