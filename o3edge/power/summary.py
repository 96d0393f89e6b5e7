"""Summaries of the energy log: per hour and priority class, and a plot of tokens/J over time."""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from o3edge.power.energy_log import rotated_paths

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SummaryRow:
    """Requests in one hour (UTC, ISO "2026-11-30T07:00Z") and priority class, and their tokens/J."""

    hour: str
    priority: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    joules: float
    tokens_per_joule: float | None  # completion tokens over joules
    low_confidence: int  # how many of the requests were flagged
    meters: str  # the meters (and domains) the figures come from, e.g. "nvml[gpu0]"


def read_log(path: str | Path, backups: int = 5) -> Iterator[dict]:
    """Records of a log and its rotated backups, oldest file first; bad lines are skipped (logged)."""
    num_bad = 0
    for file in reversed(rotated_paths(path, backups)):
        if not file.exists():
            continue
        with open(file, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                    float(record["ts"])
                except (ValueError, KeyError, TypeError):
                    num_bad += 1
                    continue
                yield record
    if num_bad:
        log.warning("skipped %d unreadable line(s) in %s", num_bad, path)


def _hour(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:00Z")


def _meter_label(record: dict) -> str:
    return f"{record.get('meter')}[{','.join(record.get('domains') or [])}]"


def summarise(records: Iterable[dict] | str | Path) -> list[SummaryRow]:
    """Rows per (hour, priority), sorted; `records` may be a log path or parsed records."""
    if isinstance(records, (str, Path)):
        records = read_log(records)
    groups: dict[tuple[str, str], dict] = {}
    for r in records:
        key = (_hour(float(r["ts"])), str(r.get("priority")))
        g = groups.setdefault(key, {"n": 0, "p": 0, "c": 0, "j": 0.0, "low": 0, "meters": set()})
        g["n"] += 1
        g["p"] += int(r.get("prompt_tokens") or 0)
        g["c"] += int(r.get("completion_tokens") or 0)
        g["j"] += float(r.get("joules") or 0.0)
        g["low"] += bool(r.get("low_confidence"))
        g["meters"].add(_meter_label(r))
    return [
        SummaryRow(hour, priority, g["n"], g["p"], g["c"], g["j"], g["c"] / g["j"] if g["j"] > 0 else None,
                   g["low"], " ".join(sorted(g["meters"])))
        for (hour, priority), g in sorted(groups.items())
    ]


def group_rows(rows: Iterable[SummaryRow], by: str) -> list[SummaryRow]:
    """Rows merged per hour (priority "*") or per priority class (hour "*"), sorted."""
    if by not in ("hour", "priority"):
        raise ValueError(f"group by 'hour' or 'priority', got {by!r}")
    groups: dict[str, list[SummaryRow]] = {}
    for row in rows:
        groups.setdefault(row.hour if by == "hour" else row.priority, []).append(row)
    merged = []
    for key, group in sorted(groups.items()):
        completion, joules = sum(r.completion_tokens for r in group), sum(r.joules for r in group)
        meters = " ".join(sorted({m for r in group for m in r.meters.split()}))
        merged.append(SummaryRow(key if by == "hour" else "*", key if by == "priority" else "*",
                                 sum(r.requests for r in group), sum(r.prompt_tokens for r in group), completion,
                                 joules, completion / joules if joules > 0 else None,
                                 sum(r.low_confidence for r in group), meters))
    return merged


def plot_tokens_per_joule(records: Iterable[dict] | str | Path, out_png: str | Path,
                          title: str = "o3edge tokens per joule") -> Path:
    """Draw each request's tokens/J over time and the hourly figure to a PNG (needs matplotlib)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(f"plotting the energy log needs matplotlib (pip install matplotlib): {exc}") from None
    if isinstance(records, (str, Path)):
        records = read_log(records)
    records = [r for r in records if r.get("tokens_per_joule") is not None]
    fig = Figure(figsize=(10, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for low, style in ((False, dict(alpha=0.5, s=8, label="request")),
                       (True, dict(alpha=0.3, s=8, marker="x", label="request (low confidence)"))):
        chosen = [r for r in records if bool(r.get("low_confidence")) == low]
        times = [dt.datetime.fromtimestamp(float(r["ts"]), dt.timezone.utc) for r in chosen]
        ax.scatter(times, [float(r["tokens_per_joule"]) for r in chosen], **style)
    half_hour = dt.timedelta(minutes=30)  # each hourly point sits mid-hour
    rows = [(dt.datetime.strptime(k, "%Y-%m-%dT%H:00Z").replace(tzinfo=dt.timezone.utc) + half_hour, c, j)
            for k, c, j in _hourly(records)]
    if rows:
        ax.plot([t for t, _, _ in rows], [c / j for _, c, j in rows], "-o", color="black", label="hourly")
    meters = sorted({_meter_label(r) for r in records}) or ["no data"]
    ax.set_title(f"{title} — {' '.join(meters)}")
    ax.set_xlabel("time (UTC)")
    ax.set_ylabel("generated tokens per joule")
    ax.legend(loc="best")
    fig.autofmt_xdate()
    out_png = Path(out_png)
    fig.savefig(out_png)
    return out_png


def _hourly(records: list[dict]) -> list[tuple[str, int, float]]:
    """(hour, completion tokens, joules) over all priorities, hours with energy only."""
    by_hour: dict[str, list] = {}
    for row in summarise(records):
        acc = by_hour.setdefault(row.hour, [0, 0.0])
        acc[0] += row.completion_tokens
        acc[1] += row.joules
    return [(h, c, j) for h, (c, j) in sorted(by_hour.items()) if j > 0]
