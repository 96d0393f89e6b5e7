"""tools/profile_router_step.py's replay figures: the kernels' busy time inside a graph's span."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

import profile_router_step  # noqa: E402


def test_busy_time_counts_overlapping_kernels_once_and_leaves_the_gaps_out():
    """Kernels launched with programmatic dependent launch overlap their predecessor: the busy time a replay
    is the union of the kernels' spans (what `span - busy` leaves is the GPU's gaps between kernels), not
    the sum of their durations."""
    spans = [(0.0, 10.0), (8.0, 15.0), (20.0, 25.0), (21.0, 22.0), (30.0, 30.0)]
    assert profile_router_step.busy_union(spans) == 20.0  # 0-15, then 20-25
    assert profile_router_step.busy_union([]) == 0.0
