"""tools/bench_router.py's helpers: the divergence figure, the table, where a run ran."""

import os
import sys
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

import bench_router  # noqa: E402


def test_first_divergence():
    assert bench_router.first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert bench_router.first_divergence([1, 9, 3], [1, 2, 3]) == 1
    assert bench_router.first_divergence([9, 2, 3], [1, 2, 3]) == 0


def _row(until=None):
    x = {"kv_bytes_per_token_bf16": 4096.0, "kv_bytes_vs_bf16": 1.0, "full_precision_token_share": 1.0,
         "mean_kl_nats": 0.0, "top1_agreement_forced": 1.0, "greedy_agreement_free": 0.5,
         "needle_found": 1.0, "copy_tokens_mean": 2.0}
    if until is not None:
        x["greedy_tokens_until_divergence"] = until
    return x


def test_table_has_the_divergence_column():
    lines = bench_router.table({"new_tokens": 64, "results": {"off": _row(64.0), "old": _row()}}).splitlines()
    assert "greedy tokens until first divergence (of 64)" in lines[0]
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == lines[3].count("|")
    assert "| 64.0 |" in lines[2] and "| n/a |" in lines[3]  # results recorded before the figure existed


def test_device_info_on_cpu():
    eng = SimpleNamespace(info=SimpleNamespace(device="cpu", dtype="float32"))
    w = bench_router.device_info(eng, 1)
    assert w["device"] == "cpu" and w["dtype"] == "float32" and w["threads"] == 1 and w["device_name"]


def test_rounds_report_the_median_and_each_rounds_ratio_to_full_precision():
    """--gpu --rounds: a setting's rows over alternating rounds, each compared with full precision's run of
    the same round, so a round where the machine ran slow for both does not count against the setting."""
    off = [{"decode_tokens_per_s": 40000.0}, {"decode_tokens_per_s": 20000.0}, {"decode_tokens_per_s": 30000.0}]
    router = [{"decode_tokens_per_s": 36000.0, "steps": 127}, {"decode_tokens_per_s": 21000.0, "steps": 127},
              {"decode_tokens_per_s": 30000.0, "steps": 127}]
    row = bench_router.over_rounds(router, off)
    assert row["decode_tokens_per_s"] == 30000.0
    assert row["ratio_to_off_by_round"] == [0.9, 1.05, 1.0]
    assert row["ratio_to_off_median"] == 1.0
    assert row["rounds"] == router and row["steps"] == 127


def test_speed_mode_times_prefill_and_decode_beside_full_precision(tmp_path):
    """--speed on the built-in model: every setting's prefill seconds and decode tokens/s, each round kept,
    and the ratios to full precision's (its own are 1)."""
    out = tmp_path / "speed.json"
    bench_router.main(["--speed", "--prompts", "1", "--prompt-tokens", "48", "--new-tokens", "5", "--only",
                       "router-int8", "--json", str(out)])
    import json

    r = json.loads(out.read_text())
    assert r["mode"] == "cpu-speed" and set(r["results"]) == {"off", "router-int8"}
    for label, res in r["results"].items():
        assert len(res["runs"]) == 1 and res["median_prefill_s"] > 0 and res["median_decode_tokens_per_s"] > 0
    assert r["results"]["off"]["prefill_vs_off"] == r["results"]["off"]["decode_vs_off"] == 1.0


def test_refresh_steps_add_the_default_and_threshold_routers_refreshing_every_n(monkeypatch):
    """--thresholds 0.3 --refresh-steps 64: the routers at threshold 0.3 (4 sink, 32 recent tokens) and the
    default ones, each also refreshing every 64 steps with the rest of its setting unchanged (call 9 of
    2026-12-05 ran router-int8-t0.3-refresh64), and nothing else gains a refresh variant."""
    monkeypatch.setattr(bench_router, "SETTINGS", dict(bench_router.SETTINGS))
    a = SimpleNamespace(tuned=False, blocks=False, thresholds="0.3", refresh_steps=64, floor=False, gpu=True)
    bench_router.add_settings(a)
    s = bench_router.SETTINGS
    assert s["router-int8-t0.3-refresh64"] == dict(kv_router="int8", router_threshold=0.3, sink_tokens=4,
                                                   recent_tokens=32, router_refresh_steps=64)
    assert s["router-int4-t0.3-refresh64"]["kv_router"] == "int4"
    assert s["router-int8-refresh64"] == dict(kv_router="int8", router_refresh_steps=64)
    assert "router-int8-t0.3" in s and "router_refresh_steps" not in s["router-int8-t0.3"]
    assert not any(k.endswith("-refresh64") for k in s if k.startswith(("off", "uniform")))


def test_summary_line_names_the_ratio_by_round_and_the_steps_by_kind():
    """The line a GPU call's log ends with for each setting: what the call's reader compares."""
    off = [{"decode_tokens_per_s": 40000.0}, {"decode_tokens_per_s": 20000.0}]
    rounds = [{"decode_tokens_per_s": 42000.0, "graph_replay_ms": 0.3231, "kv_bytes_per_token": 2192.4,
               "blocks_demoted_in_decode": 11, "by_kind": {"other": {"n": 116, "median_ms": 0.345},
                                                         "refresh": {"n": 4, "median_ms": 0.43}}},
              {"decode_tokens_per_s": 21000.0}]
    line = bench_router.summary_line("router-int8-t0.3 (CUDA graphs)", bench_router.over_rounds(rounds, off))
    assert line.startswith("router-int8-t0.3 (CUDA graphs): median 31500.0 tok/s, 1.05x of full precision")
    assert "(by round [1.05, 1.05])" in line and "GPU step 0.3231 ms" in line and "11 blocks demoted" in line
    assert "{'other': 0.345, 'refresh': 0.43}" in line
    one = bench_router.summary_line("off (CUDA graphs)", {"decode_tokens_per_s": 40000.0})
    assert one.startswith("off (CUDA graphs): 40000.0 tok/s;") and "by round" not in one


def test_a_rounds_runs_put_full_precision_first_or_last_and_eager_after_graphs():
    """--gpu's round: full precision first (--off-last: last) among the CUDA-graph runs, the settings in the
    order given, and with --eager the same again without graphs; `off` given in --only runs once a round."""
    graphs = [("off (CUDA graphs)", "off", True), ("router-int8 (CUDA graphs)", "router-int8", True),
              ("uniform-int8 (CUDA graphs)", "uniform-int8", True)]
    assert bench_router.gpu_runs(["off", "router-int8", "uniform-int8"], False) == graphs
    assert bench_router.gpu_runs(["router-int8", "uniform-int8"], False, off_last=True) == graphs[1:] + graphs[:1]
    eager = bench_router.gpu_runs(["router-int8"], True)
    assert eager == graphs[:2] + [("off (eager)", "off", False), ("router-int8", "router-int8", False)]
