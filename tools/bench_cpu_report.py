#!/usr/bin/env python3
"""Collect a tools/bench_cpu_peers.sh run (OUT/pass*/NAME.json) into one JSON and a Markdown table.

  python tools/bench_cpu_report.py OUT --json docs/results/cpu-peers-DATE.json --command "..."
  python tools/bench_cpu_report.py --plot docs/img/cpu-vs-llamacpp.png RUN.json:TITLE [RUN.json:TITLE ...]

Each cell is the median over passes of each pass's median, with [min–max] over every timed run;
ratios are against llama.cpp Q4_0 in the same passes (decode: ours / theirs; TTFT and RSS: ours / theirs).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import statistics

from machine_info import cpu_name  # tools/, this script's own folder

ORDER = ["llama.cpp Q4_0", "llama.cpp Q8_0", "o3edge cpu-int8", "o3edge cpu-int8 compiled", "o3edge cpu-int4",
         "o3edge cpu-int4-all", "o3edge cpu-int4 native", "o3edge cpu-int4-all native", "o3edge fp32"]


def load(out: str) -> dict[str, list[dict]]:
    """name -> one result per pass."""
    rows: dict[str, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(out, "pass*", "*.json"))):
        r = json.load(open(path))
        r["pass"] = os.path.basename(os.path.dirname(path))
        rows.setdefault(os.path.basename(path).removesuffix(".json"), []).append(r)
    return rows


def cell(results: list[dict], key: str) -> tuple[float, float, float]:
    """(median of pass medians, min, max over all runs)."""
    med = statistics.median(r["summary"][key]["median"] for r in results)
    return med, min(r["summary"][key]["min"] for r in results), max(r["summary"][key]["max"] for r in results)


def machine() -> str:
    cpu = cpu_name()
    flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16") if f" {f}" in flags]
    mem = int(next(ln for ln in open("/proc/meminfo") if ln.startswith("MemTotal")).split()[1]) / 2**20
    return f"{cpu}, {os.cpu_count()} vCPUs ({', '.join(isa)}), {mem:.0f} GiB, Python {platform.python_version()}"


def plot(runs: list[str], path: str) -> None:
    """One row of panels per saved run (JSON:TITLE): decode tok/s and TTFT of every system, bars at the median of
    pass medians, whiskers over every timed run, llama.cpp's bars grey; the ratio to llama.cpp Q4_0 beside each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 3.2 * len(runs)), squeeze=False)
    for row, spec in zip(axes, runs):
        file, _, title = spec.partition(":")
        table = json.load(open(file))["table"]
        names = [n for n in ORDER if n in table] + sorted(set(table) - set(ORDER))
        for ax, key, unit in ((row[0], "decode_tps", "decode, batch 1 (tok/s)"), (row[1], "ttft_ms", "TTFT, 128-token prompt (ms)")):
            med = [table[n][key][0] for n in names]
            err = [[m - table[n][key][1] for m, n in zip(med, names)], [table[n][key][2] - m for m, n in zip(med, names)]]
            colors = ["0.6" if n.startswith("llama.cpp") else "tab:blue" for n in names]
            ax.barh(names, med, xerr=err, color=colors, capsize=2)
            base = table["llama.cpp Q4_0"][key][0]
            for y, (m, n) in enumerate(zip(med, names)):  # beside the whisker's end
                ax.text(table[n][key][2], y, f"  {m / base:.2f}x", va="center", fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel(unit)
            ax.set_title(title if key == "decode_tps" else "", fontsize=9, loc="left")
            ax.set_xlim(0, 1.3 * max(table[n][key][2] for n in names))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="+", help="a run's folder; with --plot, saved runs as JSON:TITLE")
    ap.add_argument("--json")
    ap.add_argument("--command", default="bash tools/bench_cpu_peers.sh")
    ap.add_argument("--plot", help="draw the saved runs given as JSON:TITLE into this PNG instead")
    a = ap.parse_args()
    if a.plot:
        return plot(a.out, a.plot)
    a.out = a.out[0]
    rows = load(a.out)
    names = [n for n in ORDER if n in rows] + sorted(set(rows) - set(ORDER))
    loads = [r.get("loadavg_start", [0])[0] for rs in rows.values() for r in rs] + \
            [r.get("loadavg_end", [0])[0] for rs in rows.values() for r in rs]
    table = {n: {k: cell(rows[n], k) for k in ("ttft_ms", "decode_tps")} for n in names}
    for n in names:
        table[n]["peak_rss_mb"] = statistics.median(r["peak_rss_mb"] for r in rows[n])
    threads = sorted({r["threads"] for rs in rows.values() for r in rs})
    threads = threads[0] if len(threads) == 1 else threads
    base = table.get("llama.cpp Q4_0")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"- date: {date}\n- command: `{a.command}`\n- machine: {machine()}\n"
          f"- passes: {len(next(iter(rows.values())))}, each system in its own process, interleaved within each "
          f"pass; {threads} threads; 128-token prompt, 128 greedy tokens; 1 warm-up + 3 timed runs per pass\n"
          f"- load average (1 min) at the starts and ends of the processes: {min(loads):.1f}–{max(loads):.1f}\n")
    print("| system | TTFT (ms) | decode b=1 (tok/s) | peak RSS (MB) | decode / Q4_0 | TTFT / Q4_0 | RSS / Q4_0 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n in names:
        t, d, rss = table[n]["ttft_ms"], table[n]["decode_tps"], table[n]["peak_rss_mb"]
        ratios = ["–"] * 3 if base is None else [f"{d[0] / base['decode_tps'][0]:.2f}x",
                                                  f"{t[0] / base['ttft_ms'][0]:.2f}x",
                                                  f"{rss / base['peak_rss_mb']:.2f}x"]
        print(f"| {n} | {t[0]:.0f} [{t[1]:.0f}–{t[2]:.0f}] | {d[0]:.1f} [{d[1]:.1f}–{d[2]:.1f}] | {rss:.0f} | "
              + " | ".join(ratios) + " |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"date": date, "command": a.command, "threads": threads, "machine": machine(),
                       "loadavg_range": [min(loads), max(loads)],
                       "table": table, "results": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
