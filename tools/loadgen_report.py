"""The load generator's report: per level and class figures, as a rich table, Markdown, JSON and a PNG.

Used by tools/loadgen.py; see its docstring for what is measured.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from o3edge.ipc import protocol as P

CLASSES = P.PRIORITIES


@dataclass
class Record:
    """One request as the client saw it (times in seconds on the monotonic clock)."""

    level: int
    cls: str
    sent: float
    first: float | None = None
    done: float | None = None
    outcome: str = "pending"  # ok, busy, deadline_exceeded, unfinished, or another error code
    prompt_tokens: int = 0
    completion_tokens: int = 0
    server_ttft_ms: float | None = None


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-len(ordered) * q // 100) - 1))]


def summarize(level: dict, records: list[Record], cls: str) -> dict:
    """One row of the table: a level's figures for one class ('all' for every class)."""
    mine = [r for r in records if cls in ("all", r.cls)]
    ok = [r for r in mine if r.outcome == "ok"]
    ttft = [(r.first - r.sent) * 1000 for r in ok if r.first is not None]
    e2e = [(r.done - r.sent) * 1000 for r in ok]
    wall = max(level["end"] - level["start"], 1e-9)
    row = {"qps": level["qps"], "class": cls, "sent": len(mine), "ok": len(ok),
           "busy": sum(r.outcome == P.BUSY for r in mine),
           "expired": sum(r.outcome == P.DEADLINE_EXCEEDED for r in mine),
           "unfinished": sum(r.outcome in ("unfinished", "pending") for r in mine),
           "other_errors": sum(r.outcome not in ("ok", P.BUSY, P.DEADLINE_EXCEEDED, "unfinished", "pending")
                               for r in mine),
           "prompt_tokens_mean": round(sum(r.prompt_tokens for r in ok) / len(ok), 1) if ok else None,
           "requests_per_s": round(len(ok) / wall, 3),
           "tokens_per_s": round(sum(r.completion_tokens for r in ok) / wall, 2)}
    for name, values in (("ttft", ttft), ("e2e", e2e)):
        for q in (50, 95, 99):
            value = pct(values, q)
            row[f"{name}_p{q}_ms"] = None if value is None else round(value, 1)
    return row


def table_rows(result: dict, args: argparse.Namespace) -> list[dict]:
    rows = []
    for i, level in enumerate(result["levels"]):
        records = [r for r in result["records"] if r.level == i]
        rows += [summarize(level, records, cls) for cls in CLASSES if args.mix.get(cls)]
        rows.append(summarize(level, records, "all"))
    return rows


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = [("qps", "offered QPS"), ("class", "class"), ("sent", "sent"), ("ok", "ok"), ("busy", "busy"),
            ("expired", "expired"), ("unfinished", "unfinished"), ("other_errors", "other"),
            ("ttft_p50_ms", "TTFT p50"),
            ("ttft_p95_ms", "p95"), ("ttft_p99_ms", "p99"), ("e2e_p50_ms", "E2E p50"), ("e2e_p95_ms", "p95"),
            ("e2e_p99_ms", "p99"), ("requests_per_s", "req/s"), ("tokens_per_s", "tok/s")]
    for _, header in cols:
        table.add_column(header, justify="left" if header == "class" else "right")
    for row in rows:
        table.add_row(*("–" if row[k] is None else f"{row[k]:g}" if isinstance(row[k], float) else str(row[k])
                        for k, _ in cols), end_section=row["class"] == "all")
    console = Console(width=max(Console().width, 160))
    console.print(table)
    console.print("latencies in ms, as the client saw them (TTFT: send → first token; E2E: send → done); "
                  "unfinished: cancelled when the drain or the time limit ran out")


def markdown_table(rows: list[dict]) -> str:
    """The same table as Markdown (for docs/benchmarks.md)."""
    head = ("| offered QPS | class | sent | ok | busy | expired | unfinished | TTFT p50 / p95 / p99 (ms) | "
            "E2E p50 / p95 / p99 (ms) | req/s | tok/s |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    fmt = lambda *v: " / ".join("–" if x is None else f"{x:.0f}" for x in v)  # noqa: E731
    return head + "".join(
        f"| {r['qps']:g} | {r['class']} | {r['sent']} | {r['ok']} | {r['busy']} | {r['expired']} | "
        f"{r['unfinished']} | "
        f"{fmt(r['ttft_p50_ms'], r['ttft_p95_ms'], r['ttft_p99_ms'])} | "
        f"{fmt(r['e2e_p50_ms'], r['e2e_p95_ms'], r['e2e_p99_ms'])} | {r['requests_per_s']:g} | "
        f"{r['tokens_per_s']:g} |\n" for r in rows)


def write_json(path: str, args: argparse.Namespace, result: dict, rows: list[dict]) -> None:
    """Everything: the arguments, the daemon's info, the table, each level's `stats`, every request."""
    t0 = result["levels"][0]["start"] if result["levels"] else 0.0
    levels = [{"qps": level["qps"], "seconds": round(level["end"] - level["start"], 3), "stats": level["stats"]}
              for level in result["levels"]]
    records = [{k: round(v - t0, 4) if k in ("sent", "first", "done") and v is not None else v
                for k, v in asdict(r).items()} for r in result["records"]]  # seconds from the first level
    with open(path, "w") as fh:
        json.dump({"args": vars(args), "info": result["info"], "rows": rows, "levels": levels, "records": records},
                  fh, indent=1, default=str)


def plot(rows: list[dict], path: str, title: str) -> None:
    """Latency (p50 dashed, p95 solid) against offered QPS, one colour per class; TTFT and end to end."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=90)
    colours = dict(zip(CLASSES, ("tab:red", "tab:orange", "tab:blue", "tab:gray")))
    for ax, metric, name in ((axes[0], "ttft", "time to first token"), (axes[1], "e2e", "end-to-end latency")):
        for cls in CLASSES:
            mine = [r for r in rows if r["class"] == cls and r[f"{metric}_p95_ms"] is not None]
            if not mine:
                continue
            qps = [r["qps"] for r in mine]
            ax.plot(qps, [r[f"{metric}_p95_ms"] for r in mine], "o-", color=colours[cls], label=f"{cls} p95")
            ax.plot(qps, [r[f"{metric}_p50_ms"] for r in mine], "--", color=colours[cls], alpha=0.6)
        ax.set(xlabel="offered load (requests/s)", ylabel="ms (log)", title=name, yscale="log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].plot([], [], "--", color="black", alpha=0.6, label="p50 (dashed)")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
