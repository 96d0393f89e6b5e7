#!/usr/bin/env python3
"""Where a host loop's time goes, from py-spy's raw stacks: each function's inclusive share of the samples taken
inside an anchor frame (e.g. a benchmark's decode loop), most first.

  py-spy record -r 1000 -f raw -o spy.txt -- python tools/bench_router.py --gpu --shape model ...
  python tools/spy_share.py spy.txt[.gz] --anchor "bench_router.py:435" [--top 40]

The anchor is a frame's "file:line" (the line of the call whose time is shared out); frames are counted by
function, whatever their line, once per sample.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re


def shares(path: str, anchor: str) -> tuple[int, collections.Counter]:
    """(samples inside the anchor frame, samples by function below it, each counted once a sample)."""
    opener = gzip.open if path.endswith(".gz") else open
    total, incl = 0, collections.Counter()
    with opener(path, "rt") as fh:
        for line in fh:
            stack, _, n = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            at = next((i for i, f in enumerate(frames) if anchor + ")" in f), None)
            if at is None:
                continue
            total += int(n)
            for f in {re.sub(r":\d+\)$", ")", f) for f in frames[at + 1:]}:
                incl[f] += int(n)
    return total, incl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw")
    ap.add_argument("--anchor", required=True, help='the loop\'s call, as "file.py:line"')
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    total, incl = shares(a.raw, a.anchor)
    print(f"{total} samples inside {a.anchor}")
    for name, n in incl.most_common(a.top):
        print(f"{100 * n / max(total, 1):5.1f}%  {name}")


if __name__ == "__main__":
    main()
