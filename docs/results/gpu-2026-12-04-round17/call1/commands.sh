# call 1 (2026-12-04 fourteenth session): the router on the trained model, today's code, with the host sampled
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
(nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv; lscpu | grep -E "Model name|^CPU\(s\)|MHz") > $OUT/machine.txt
python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 3 --only off,router-int8,router-int4 --json $OUT/router-model.json 2>&1 | grep -v -i warn | tail -40
py-spy record -r 1000 -f raw -o /tmp/spy.txt -- python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 1 --only off,router-int8 --json $OUT/router-spy.json > $OUT/spy-run.log 2>&1
tail -5 $OUT/spy-run.log
gzip -c /tmp/spy.txt > $OUT/spy-int8.txt.gz
timeout 200 python3 -m pytest -m gpu tests/engine/test_router_graph.py tests/engine/test_router.py -q -x 2>&1 | tail -5 > $OUT/gpu-tests.log
cat $OUT/gpu-tests.log
