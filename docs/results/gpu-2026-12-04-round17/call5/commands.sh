# call 5 (2026-12-04 fourteenth session): the router's host work on the H200 machine's CPU, for the next session:
# ordinary steps with no refresh (the model stubbed out) beside full precision's; a refresh's demotions alone
# (books, and the flush by the kernel with its parts)
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
for s in off router-int8; do
  O3EDGE_CPU_KERNELS=torch timeout 60 python3 tools/bench_host_step.py --setting $s --repeat 3 --steps 256 --refresh-steps 100000 --json $OUT/host-$s.json 2>&1 | tail -1
done
for m in int8 int4; do
  timeout 60 python3 tools/bench_demotions.py --mode $m --repeat 40 --profile --json $OUT/demotions-$m.json > $OUT/demotions-$m.log 2>&1
  tail -2 $OUT/demotions-$m.log
done
