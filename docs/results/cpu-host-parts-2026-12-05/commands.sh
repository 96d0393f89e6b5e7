# 2026-12-05, twenty-first session, this CPU machine (2 cores): a refresh cycle's host work by part
# (tools/bench_host_step.py --parts, new), the trained model at 16 x 3,840, 128 steps, two runs each
for s in router-int8 off; do
  O3EDGE_CPU_KERNELS=torch python tools/bench_host_step.py --setting $s --batch 16 --context 3840 --steps 128 \
    --repeat 2 --clock thread --parts --json docs/results/cpu-host-parts-2026-12-05/host-$s.json
done
