# call 5 (2026-12-05, twenty-third session): fine tiles (quant_attention.fine_tiles: INT8 launches in 16 key splits
# or more take 64-key compressed tiles and joined splits) as the default, against O3EDGE_ROUTER_FINE=0 (the tiling
# before): the kernels alone at the trained model's shape (INT8, and INT4 forced with FINE=1), the GPU tests of the
# router kernel and graphs, the kernels alone at llama-1b with 2 sequences (32 splits, where the rule also
# applies), then whole decode on the trained model. Everything goes into one archive.
LIMIT=${CALL_LIMIT_S:-400}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
cp docs/results/gpu-2026-12-05f/call5.sh $R/commands.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
cat $R/machine.txt
pack() { tar czf $OUT/call5.tgz -C $R .; }
attn() {  # name, shape, batch, context, cases, then environment assignments
  name=$1 shape=$2 batch=$3 ctx=$4 cases=$5; shift 5
  [ $SECONDS -gt $((LIMIT - 45)) ] && { echo "skip attn $name at ${SECONDS}s"; return; }
  env "$@" timeout 60 python3 tools/bench_attention.py --shape $shape --batch $batch --context $ctx \
    --cases $cases --json $R/attn-$name.json > $R/attn-$name.log 2>&1
  echo "attn $name: $(grep -E 'planned' $R/attn-$name.log | sed 's/; best.*//' | paste -sd' ') at ${SECONDS}s"
  pack
}
attn ref-fine ref-long 16 3840 off,int8-0.73 O3EDGE_NOTHING=1
attn ref-before ref-long 16 3840 int8-0.73 O3EDGE_ROUTER_FINE=0
attn ref-int4-fine ref-long 16 3840 int4-0.73 O3EDGE_ROUTER_FINE=1
attn ref-int4-before ref-long 16 3840 int4-0.73 O3EDGE_NOTHING=1
timeout 150 python3 -m pytest -q -m gpu tests/engine/test_router_graph.py tests/engine/test_router.py \
  -k "graph or many_splits or joined" -p no:cacheprovider > $R/tests.log 2>&1
tail -n 2 $R/tests.log; echo "tests at ${SECONDS}s"; pack
attn l1b-b2-fine llama-1b 2 4096 off,int8-0.73 O3EDGE_NOTHING=1
attn l1b-b2-before llama-1b 2 4096 int8-0.73 O3EDGE_ROUTER_FINE=0
run() {  # name, then environment assignments
  name=$1; shift
  [ $SECONDS -gt $((LIMIT - 60)) ] && { echo "skip $name at ${SECONDS}s"; return; }
  env "$@" timeout 80 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 3 \
    --only off,router-int8 --json $R/router-$name.json > $R/router-$name.log 2>&1
  python3 - $R/router-$name.json $name <<'PY'
import json, sys
res = json.load(open(sys.argv[1]))["results"]
off, rt = res["off (CUDA graphs)"], res["router-int8 (CUDA graphs)"]
print(sys.argv[2], "ratio", rt["ratio_to_off_median"], rt["ratio_to_off_by_round"], "replay",
      off["graph_replay_ms"], rt["graph_replay_ms"], "steps", {k: v["median_ms"] for k, v in rt["by_kind"].items()})
PY
  pack
}
run fine O3EDGE_NOTHING=1
run before O3EDGE_ROUTER_FINE=0
pack
echo "done at ${SECONDS}s"
