# call 4 (2026-12-05, twenty-second session): the route graph on a stream of its own (RouterDecodeGraphs.route_stream)
# (O3EDGE_ROUTER_ROUTE_STREAM=1, 261452e; reverted after this call and call 5) against the step's stream: the router
# graph's GPU tests, then whole decode on the trained model at 16 x 3,840 (router INT8 against full precision in the
# same process, one round a process, alternating), then a trace of the router's steps with the stream. Everything goes
# into one archive.
LIMIT=${CALL_LIMIT_S:-400}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=/tmp/r4; mkdir -p $R
cp docs/results/gpu-2026-12-05e/call4.sh $R/commands.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
pack() { tar czf $OUT/call4.tgz -C $R .; }
timeout 110 python3 -m pytest -v -m gpu tests/engine/test_router_graph.py -p no:cacheprovider > $R/tests.log 2>&1
tail -n 1 $R/tests.log; grep -E "FAIL|Error" $R/tests.log | head -5; pack
run() {  # name, time limit, environment assignments
  name=$1; limit=$2; shift 2
  [ $SECONDS -gt $((LIMIT - limit)) ] && { echo "skip $name at ${SECONDS}s"; return; }
  env "$@" timeout $limit python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 1 \
    --only off,router-int8 --json $R/router-$name.json > $R/router-$name.log 2>&1
  python3 - $R/router-$name.json $name <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))["results"]
off, rt = d["off (CUDA graphs)"], d["router-int8 (CUDA graphs)"]
print(sys.argv[2], "ratio", round(rt["decode_tokens_per_s"] / off["decode_tokens_per_s"], 3), "tok/s", off["decode_tokens_per_s"],
      rt["decode_tokens_per_s"], "steps", off["by_kind"]["other"]["median_ms"], {k: v["median_ms"] for k, v in rt["by_kind"].items()})
PY
  pack
}
run stream-1 110 O3EDGE_ROUTER_ROUTE_STREAM=1
run step-1 50 O3EDGE_NOTHING=1
run stream-2 50 O3EDGE_ROUTER_ROUTE_STREAM=1
run step-2 50 O3EDGE_NOTHING=1
[ $SECONDS -lt $((LIMIT - 60)) ] && O3EDGE_ROUTER_ROUTE_STREAM=1 timeout 60 python3 tools/profile_router_step.py --trace --shape model --context 3840 \
  --batch 16 --setting router-int8 --json $R/trace-router-int8.json > $R/trace-router-int8.log 2>&1 && python3 - $R/trace-router-int8.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print({k: (v["wall_ms"], v["gpu_idle_ms"]) for k, v in d["by_kind_median_ms"].items()})
for k, v in d["gpu_kernels_per_decode_step"].items():
    if v["calls"] < 0.9:
        print(k[:70], round(v["ms"] / v["calls"], 4), "ms a call")
PY
pack
run stream-3 50 O3EDGE_ROUTER_ROUTE_STREAM=1
run step-3 50 O3EDGE_NOTHING=1
echo "done at ${SECONDS}s"
