# The host's graph decode step with the metadata rows kept while tables are unchanged (e447482, with 982c944)
# against 894534c (each table's entries copied and compared each row each step), alternating, on the CPU machine
# (2 cores; the device's part stubbed: tools/bench_host_step.py). Run from /work/main with 894534c checked out
# in /tmp/base (git worktree add /tmp/base 894534c).
D=docs/results/cpu-host-step-2026-12-05
for i in 1 2; do
  for t in base new; do
    dir=$([ $t = base ] && echo /tmp/base || echo $PWD)
    for s in off router-int8; do
      (cd $dir && PYTHONPATH=$dir python tools/bench_host_step.py --setting $s --batch 16 --context 3840 --steps 512 \
        --repeat 3 --json $OLDPWD/$D/host-$t-$s-$i.json > /dev/null 2>&1)
    done
    (cd $dir && python $dir/tools/bench_step_meta.py > $OLDPWD/$D/meta-$t-$i.txt 2>&1)
  done
done
