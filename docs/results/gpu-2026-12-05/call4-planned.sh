# planned call 4 (2026-12-05; no device machine started for it, and too little device time was left: run it in the next session with a GPU): the GPU tests of the graph paths on the code with INT4 prompt tiles and the router's move graph
# on by default and decode metadata rows memoized by table identity and written only where they changed (e447482):
# the router's graph steps and the plain graph path (launched ahead, INT4, sampling); then one round of whole decode
# on the trained model, full precision beside the router (indicative only: no run of the code before in this call).
# The whole `-m gpu` suite takes more than the device time this session had left.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
timeout 115 python3 -m pytest -v -m gpu tests/engine/test_router_graph.py tests/engine/test_gpu.py -p no:cacheprovider > $R/tests-gpu.log 2>&1; grep -cE 'PASSED' $R/tests-gpu.log; grep -E 'FAILED|ERROR' $R/tests-gpu.log | head; tail -1 $R/tests-gpu.log
[ -n "$BENCH" ] && timeout 55 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 1 --only off,router-int8 \
  --json $R/router.json 2>&1 | grep -E "x of full|tok/s" | tail -3
tar czf $OUT/call4.tar.gz -C $OUT r && rm -rf $R
