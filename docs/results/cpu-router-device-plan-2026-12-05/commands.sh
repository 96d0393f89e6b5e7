# 2026-12-05 twentieth session, CPU machine (2 cores, no GPU): a graph refresh's rows split into the pools and its
# demotions found on the device (KVRouter.entry_rows, observation_of, plan_mask) against 8b1edf5, three alternating
# rounds, each tree's own o3edge with this commit's tools/bench_router_plan.py
git worktree add /tmp/wt-head 8b1edf5 && cp tools/bench_router_plan.py /tmp/wt-head/tools/
for i in 1 2 3; do
  python /tmp/wt-head/tools/bench_router_plan.py --root /tmp/wt-head > before-$i.json
  python tools/bench_router_plan.py > after-$i.json
done
# whole steps in place, the host step with the device stubbed (tools/bench_host_step.py), 8b1edf5 in a worktree
# against this tree, three alternating rounds of two runs each (host-old-*.json, host-new-*.json)
git worktree add /tmp/wt-old 8b1edf5
for i in 1 2 3; do
  (cd /tmp/wt-old && O3EDGE_CPU_KERNELS=torch python tools/bench_host_step.py --setting router-int8 --batch 16 \
    --context 3840 --steps 128 --repeat 2 --clock thread --json host-old-$i.json)
  O3EDGE_CPU_KERNELS=torch python tools/bench_host_step.py --setting router-int8 --batch 16 --context 3840 \
    --steps 128 --repeat 2 --clock thread --json host-new-$i.json
done
