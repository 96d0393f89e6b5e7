# call 5 (2026-12-05, twenty-second session): call 4's whole-decode pairs again, the route graph on its own stream
# (O3EDGE_ROUTER_ROUTE_STREAM=1) against the step's stream, alternating, on the same warm machine.
LIMIT=${CALL_LIMIT_S:-250}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=/tmp/r5; mkdir -p $R
cp docs/results/gpu-2026-12-05e/call5.sh $R/commands.sh
pack() { tar czf $OUT/call5.tgz -C $R .; }
run() {  # name, environment assignments
  name=$1; shift
  [ $SECONDS -gt $((LIMIT - 45)) ] && { echo "skip $name at ${SECONDS}s"; return; }
  env "$@" timeout 45 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 1 \
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
for i in 4 5 6 7; do run step-$i O3EDGE_NOTHING=1; run stream-$i O3EDGE_ROUTER_ROUTE_STREAM=1; done
echo "done at ${SECONDS}s"
