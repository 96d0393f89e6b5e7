# call 4 (2026-12-05): every GPU test on the code with INT4 prompt tiles and the router's move graph on by default and decode metadata rows memoized by table identity (982c944),
# then the kernel tests compiled (they run under Triton's interpreter in CI)
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
timeout 280 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > $R/tests-gpu.log 2>&1; tail -3 $R/tests-gpu.log
timeout 80 python3 -m pytest -q -x tests/engine/test_kernels.py tests/engine/test_kv_quantize.py -p no:cacheprovider > $R/tests-kernels.log 2>&1; tail -1 $R/tests-kernels.log
tar czf $OUT/call4.tar.gz -C $OUT r && rm -rf $R
