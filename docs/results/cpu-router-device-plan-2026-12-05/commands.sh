# 2026-12-05 twentieth session, CPU machine (2 cores, no GPU): a graph refresh's rows split into the pools and its
# demotions found on the device (KVRouter.entry_rows, observation_of, plan_mask) against 8b1edf5, three alternating
# rounds, each tree's own o3edge with this commit's tools/bench_router_plan.py
git worktree add /tmp/wt-head 8b1edf5 && cp tools/bench_router_plan.py /tmp/wt-head/tools/
for i in 1 2 3; do
  python /tmp/wt-head/tools/bench_router_plan.py --root /tmp/wt-head > before-$i.json
  python tools/bench_router_plan.py > after-$i.json
done
