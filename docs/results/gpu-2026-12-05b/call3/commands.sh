# call 3 (2026-12-05, eighteenth session): the trained model's decode step by kernel without PDL (each kernel's own
# time: with PDL a kernel's time includes its wait for the one before), full precision and router INT8, to find the
# router step's extra ~34 us of GPU time (call 2: 0.336-0.337 ms replays against 0.302); then the graph paths' GPU
# tests on the decode-metadata change with the time they need (call 1 cut them at 115 s after 6 of 20).
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
for s in off router-int8; do
  O3EDGE_PDL=0 timeout 80 python3 tools/profile_router_step.py --trace --shape model --context 3840 --batch 16 --setting $s \
    --steps 64 --json $R/trace-nopdl-$s.json > $R/trace-nopdl-$s.log 2>&1
  python3 -c "
import json; d = json.load(open('$R/trace-nopdl-$s.json')); print('$s', d['gpu_ms_per_decode_step'], d['by_kind_median_ms'])
for k, v in list(d['gpu_kernels_per_decode_step'].items())[:10]: print('  ', k[:60], v)"
done
timeout 260 python3 -m pytest -v -m gpu tests/engine/test_router_graph.py tests/engine/test_gpu.py -p no:cacheprovider > $R/tests-gpu.log 2>&1; grep -cE 'PASSED' $R/tests-gpu.log; grep -E 'FAILED|ERROR' $R/tests-gpu.log | head; tail -1 $R/tests-gpu.log
tar czf $OUT/call3.tar.gz -C $OUT r && rm -rf $R
