# call 1 (2026-12-05, eighteenth session): docs/results/gpu-2026-12-05/call4-planned.sh with two router rounds: the GPU
# tests of the graph paths on the decode-metadata change (e447482, 390bf1a), then whole decode on the trained model,
# full precision beside the router INT8, each setting's GPU step alone too (bench_router.replay_ms, new: the last
# step's graph replayed 200 times back to back).
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
timeout 115 python3 -m pytest -v -m gpu tests/engine/test_router_graph.py tests/engine/test_gpu.py -p no:cacheprovider > $R/tests-gpu.log 2>&1; grep -cE 'PASSED' $R/tests-gpu.log; grep -E 'FAILED|ERROR' $R/tests-gpu.log | head; tail -1 $R/tests-gpu.log
timeout 150 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 2 --only off,router-int8 \
  --json $R/router.json > $R/router.log 2>&1; grep -E "x of full" $R/router.log; grep -oE "'(graph_replay|observe_replay|step)_ms_p50': [0-9.]+|'(graph_replay|observe_replay)_ms': [0-9.]+" $R/router.log | paste -sd' '
tar czf $OUT/call1.tar.gz -C $OUT r && rm -rf $R
