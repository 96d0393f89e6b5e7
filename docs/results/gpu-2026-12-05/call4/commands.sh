# call 4 (2026-12-05): the GPU tests of the graph paths on the code with INT4 prompt tiles and the router's move graph
# on by default and decode metadata rows memoized by table identity (982c944): the router's graph steps, the plain
# graph path (launched ahead, INT4, sampling), then the demotion kernels' tests compiled. (The whole `-m gpu` suite
# takes more than the device time this session had left.)
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
timeout 220 python3 -m pytest -v -m gpu tests/engine/test_router_graph.py tests/engine/test_gpu.py -p no:cacheprovider > $R/tests-gpu.log 2>&1; tail -3 $R/tests-gpu.log
timeout 60 python3 -m pytest -q -x tests/engine/test_kv_quantize.py -p no:cacheprovider > $R/tests-kv-quantize.log 2>&1; tail -1 $R/tests-kv-quantize.log
tar czf $OUT/call4.tar.gz -C $OUT r && rm -rf $R
