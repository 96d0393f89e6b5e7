# call 2 (2026-12-04 fourteenth session): is the trained model's decode host-bound on the H200? the router's step
# traced beside full precision's; the host's stubbed step on this machine's CPU; Event.record on an explicit
# stream (new) against HEAD 11a940e (old, scratch/old), alternating
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
(nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv; lscpu | grep -E "Model name|^CPU\(s\)|MHz|Flags" | cut -c1-200) > $OUT/machine.txt
M=$PWD/o3edge/models/o3edge-ref-long-int4
for s in off router-int8; do
  python3 tools/profile_router_step.py --trace --shape model --context 3840 --batch 16 --setting $s --json $OUT/trace-$s.json 2>&1 | grep -v -i warn | tail -30
done
O3EDGE_CPU_KERNELS=torch python3 tools/bench_host_step.py --setting off --repeat 2 --steps 256 --json $OUT/host-off.json 2>&1 | tail -2
mkdir -p /tmp/ab
for i in 1 2; do
  for v in new old; do
    if [ $v = new ]; then T=tools; else T=scratch/old/tools; fi
    python3 $T/bench_router.py --gpu --shape model --model $M --context 3840 --batch 16 --rounds 2 --only off,router-int8 --json /tmp/ab/ab-$v-$i.json 2>&1 | grep "x of full"
  done
done
tar czf $OUT/ab.tar.gz -C /tmp/ab .
