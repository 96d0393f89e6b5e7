# The router's ordinary graph decode step's host work after 955224d against a16a9d3 (the code before it), alternating,
# on the CPU machine (2 cores; the device's part stubbed: tools/bench_host_step.py), ordinary steps only (no refresh).
# Run from /work/main with a16a9d3 checked out in /tmp/base (git worktree add /tmp/base a16a9d3).
D=docs/results/cpu-host-step-2026-12-05b
for i in 1 2 3; do
  for t in base new; do
    dir=$([ $t = base ] && echo /tmp/base || echo $PWD)
    for s in off router-int8; do
      (cd $dir && PYTHONPATH=$dir python tools/bench_host_step.py --setting $s --batch 16 --context 3840 --steps 512 \
        --repeat 3 --refresh-steps 100000 --json $OLDPWD/$D/host-$t-$s-$i.json > /dev/null 2>&1)
    done
  done
done
