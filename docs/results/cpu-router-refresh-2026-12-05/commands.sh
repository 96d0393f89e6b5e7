# A refresh's host work after d28ab18 against the commit before it (checked out in /tmp/base3: git worktree add
# /tmp/base3 d28ab18~1), alternating, on the CPU machine (2 cores). bench_router_plan.py prints JSON lines (each part's
# best-of-repeat us); bench_demotions.py --device cpu: a refresh's 176 demotions' books and flush (torch's flush here).
D=docs/results/cpu-router-refresh-2026-12-05
for i in 1 2; do
  for t in base new; do
    dir=$([ $t = base ] && echo /tmp/base3 || echo $PWD)
    python tools/bench_router_plan.py --root $dir > $D/plan-$t-$i.txt 2>&1
    (cd $dir && PYTHONPATH=$dir python tools/bench_demotions.py --device cpu --demotions 176 --repeat 50 \
      --json $OLDPWD/$D/demotions-$t-$i.json > $OLDPWD/$D/demotions-$t-$i.txt 2>&1)
  done
done
