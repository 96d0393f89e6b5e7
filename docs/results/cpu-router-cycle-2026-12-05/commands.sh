#!/bin/bash
# 2026-12-05 nineteenth session, CPU machine (2 cores, AMD EPYC, no GPU). base = a git worktree of 16148a9 at
# /tmp/base with this commit's tools/bench_router_plan.py and tools/bench_host_step.py copied in; new = this tree.
# Parts of a refresh cycle timed alone (min of 7 x 2000 calls), alternating, three rounds:
for i in 1 2 3; do
  python tools/bench_router_plan.py > plan-new-$i.json
  (cd /tmp/base && python tools/bench_router_plan.py) > plan-base-$i.json
done
# Whole steps in place (the device stubbed, its time taken off; this thread's CPU time), alternating, three rounds:
for i in 1 2 3; do
  (cd /tmp/base && python tools/bench_host_step.py --setting router-int8 --batch 16 --context 3840 --steps 128 \
     --repeat 3 --clock thread --json host-base-router-int8-$i.json)
  python tools/bench_host_step.py --setting router-int8 --batch 16 --context 3840 --steps 128 --repeat 3 \
     --clock thread --json host-new-router-int8-$i.json
done
# The same again with this tree first in each round (an order effect showed: the second of a pair ran slower):
for i in 1 2 3; do
  python tools/bench_host_step.py --setting router-int8 --batch 16 --context 3840 --steps 128 --repeat 3 \
     --clock thread --json host-new-router-int8-newfirst-$i.json
  (cd /tmp/base && python tools/bench_host_step.py --setting router-int8 --batch 16 --context 3840 --steps 128 \
     --repeat 3 --clock thread --json host-base-router-int8-newfirst-$i.json)
done
# How the routing settles over a decode (the real model on this CPU, 4 x 3,840 tokens, 128 steps), and the experiment
# that covers the threshold without the sinks' and the recent window's saliency:
python tools/router_settling.py --json settling-4x3840.json
python tools/router_settling.py --pinned-out --json settling-4x3840-pinned-out.json
# The observing step's rows split into the pools for all rows at once (split_rows), against 27472c2 (the plan from
# per-row splits) and 16148a9, each a worktree with this commit's tools/bench_router_plan.py, three rounds:
for i in 1 2 3; do
  python tools/bench_router_plan.py > rows-new-$i.json
  (cd /tmp/base2 && python tools/bench_router_plan.py) > rows-27472c2-$i.json
  (cd /tmp/base && python tools/bench_router_plan.py) > rows-16148a9-$i.json
done
