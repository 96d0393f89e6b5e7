# planned call 7 (2026-12-05 nineteenth session; not run: no device was lent): the trained model's router against full
# precision with this session's lighter refresh cycle (27472c2: the plan from the observing step's rows, a refresh
# step's end deferring at once), and the same host work on the GPU machine's CPU with the device stubbed, where a
# refresh cycle's host time above ordinary steps was ~1.16 ms (call 4). Three rounds, alternating in one process;
# then tools/bench_host_step.py (its stubs now route as the H200's run does) for both settings, by the thread's CPU
# time, twice each. ~4 minutes.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
timeout 200 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 3 \
  --only off,router-int8 --json $R/router-rounds.json > $R/router-rounds.log 2>&1
grep -E "ratio|by_kind" $R/router-rounds.log | tail -4
for i in 1 2; do
  for s in off router-int8; do
    O3EDGE_CPU_KERNELS=torch timeout 60 python3 tools/bench_host_step.py --setting $s --batch 16 --context 3840 \
      --steps 128 --repeat 2 --clock thread --json $R/host-$s-$i.json > /dev/null 2>&1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], [(r['mean_ms'], r['cycle_extra_ms'], {k: v['median_ms'] for k, v in r['by_kind'].items()}) for r in d['runs']])" $R/host-$s-$i.json
  done
done
