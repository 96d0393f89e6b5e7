# call 2 (2026-12-05, eighteenth session): the router's decode kernel with each key split reading one pool
# (O3EDGE_ROUTER_POOLS_APART=1, e091a35): its GPU tests (bfloat16, float16 dots, both ways), then whole decode on the
# trained model at 16 x 3,840, full precision and router INT8 in each process, each setting's GPU step alone too
# (graph_replay_ms): pools together (the default), apart, apart with 8 programs an SM (O3EDGE_ROUTER_PER_SM=8).
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
timeout 130 python3 -m pytest -v -m gpu tests/engine/test_router.py -p no:cacheprovider \
  -k "(router_decode_kernel_on_the_gpu and dtype1 and (f16 or halves)) or observes_on_the_gpu" > $R/tests-kernel.log 2>&1
grep -cE 'PASSED' $R/tests-kernel.log; grep -E 'FAILED|ERROR' $R/tests-kernel.log | head; tail -1 $R/tests-kernel.log
run() {  # name, then environment assignments
  name=$1; shift
  env "$@" timeout 100 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 1 \
    --only off,router-int8 --json $R/router-$name.json > $R/router-$name.log 2>&1
  echo "$name: $(grep -oE "'(graph_replay|observe_replay|step)_ms(_p50)?': [0-9.]+|'decode_tokens_per_s': [0-9.]+" $R/router-$name.log | paste -sd' ')"
}
run together O3EDGE_ROUTER_POOLS_APART=0
run apart O3EDGE_ROUTER_POOLS_APART=1
run apart-persm8 O3EDGE_ROUTER_POOLS_APART=1 O3EDGE_ROUTER_PER_SM=8
tar czf $OUT/call2.tar.gz -C $OUT r && rm -rf $R
