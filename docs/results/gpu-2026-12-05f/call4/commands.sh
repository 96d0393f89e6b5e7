# call 4 (2026-12-05, twenty-third session): the router's joined key splits with 64-key compressed tiles
# (O3EDGE_ROUTER_JOINED=1 O3EDGE_ROUTER_TILING=64,64,4,2: the best GPU step an H100 gave, 0.325 ms against
# 0.334-0.336) against the default and joined alone, whole decode on the trained model at 16 x 3,840 on an H200,
# whose host ran steadily in call 3 (router 0.877-0.899x in five of six rounds). Three rounds a process
# (full precision and the router alternating in each), the settings alternating, two processes each; then the
# kernels alone (tools/bench_attention.py) for the same settings. Everything goes into one archive.
LIMIT=${CALL_LIMIT_S:-560}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
cp docs/results/gpu-2026-12-05f/call4.sh $R/commands.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
cat $R/machine.txt
pack() { tar czf $OUT/call4.tgz -C $R .; }
run() {  # name, then environment assignments
  name=$1; shift
  [ $SECONDS -gt $((LIMIT - 70)) ] && { echo "skip $name at ${SECONDS}s"; return; }
  env "$@" timeout $T python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 3 \
    --only off,router-int8 --json $R/router-$name.json > $R/router-$name.log 2>&1
  python3 - $R/router-$name.json $name <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
res = d["results"]
off, rt = res["off (CUDA graphs)"], res["router-int8 (CUDA graphs)"]
print(sys.argv[2], "ratio", rt["ratio_to_off_median"], rt["ratio_to_off_by_round"], "replay",
      off["graph_replay_ms"], rt["graph_replay_ms"], "steps", {k: v["median_ms"] for k, v in rt["by_kind"].items()})
PY
  pack
}
T=150  # the first process compiles the kernels
for i in 1 2; do
  run default-$i O3EDGE_NOTHING=1; T=90
  run ctile64-$i O3EDGE_ROUTER_JOINED=1 O3EDGE_ROUTER_TILING=64,64,4,2
  run joined-$i O3EDGE_ROUTER_JOINED=1
done
attn() {  # name, then environment assignments
  name=$1; shift
  [ $SECONDS -gt $((LIMIT - 45)) ] && { echo "skip attn $name at ${SECONDS}s"; return; }
  env "$@" timeout 40 python3 tools/bench_attention.py --shape ref-long --batch 16 --context 3840 \
    --cases off,int8-0.73 --json $R/attn-$name.json > $R/attn-$name.log 2>&1
  echo "attn $name: $(grep -E 'planned' $R/attn-$name.log | paste -sd' ')"
  pack
}
attn default O3EDGE_NOTHING=1
attn ctile64 O3EDGE_ROUTER_JOINED=1 O3EDGE_ROUTER_TILING=64,64,4,2
pack
echo "done at ${SECONDS}s"
