# call 4 (2026-12-05, eighteenth session): the router's lighter ordinary host step (955224d) on the GPU: the router's
# graph tests; whole decode on the trained model, two rounds; the router kernel tiled with two warps a program and two
# blocks a compressed tile at 8 programs an SM (O3EDGE_ROUTER_TILING, O3EDGE_ROUTER_PER_SM: more programs, more bytes
# in flight an SM), its GPU step alone against the default's; then the graph tests call 3 did not reach (int8
# weights, launch ahead across blocks, sampled rows, the first sampled requests, capture during garbage). Files go to
# $OUT as they are made (the call may be cut by the device time left).
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
timeout 80 python3 -m pytest -v -m gpu tests/engine/test_router_graph.py -p no:cacheprovider > $R/tests-router-graph.log 2>&1
grep -cE 'PASSED' $R/tests-router-graph.log; grep -E 'FAILED|ERROR' $R/tests-router-graph.log | head; tail -1 $R/tests-router-graph.log
run() {  # name, rounds, then environment assignments
  name=$1; rounds=$2; shift 2
  env "$@" timeout $((50 * rounds + 10)) python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 \
    --rounds $rounds --only off,router-int8 --json $R/router-$name.json > $R/router-$name.log 2>&1
  echo "$name: $(grep -oE "'(graph_replay|step)_ms(_p50)?': [0-9.]+|'decode_tokens_per_s': [0-9.]+|x of full.*" $R/router-$name.log | paste -sd' ')"
}
run default 2 O3EDGE_NOTHING=1
run warps2 1 O3EDGE_ROUTER_TILING=64,64,2,2 O3EDGE_ROUTER_PER_SM=8
timeout 150 python3 -m pytest -v -m gpu tests/engine/test_gpu.py -p no:cacheprovider \
  -k "int8_weights or serve_sequences or sampled_rows or first_sampled or garbage" > $R/tests-gpu.log 2>&1
grep -cE 'PASSED' $R/tests-gpu.log; grep -E 'FAILED|ERROR' $R/tests-gpu.log | head; tail -1 $R/tests-gpu.log
