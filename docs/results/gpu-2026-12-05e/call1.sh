# call 1 (2026-12-05, twenty-second session; the twenty-first's call 3, not run then, with the route graph's scatter
# spread (router.py observe_books) and a trace of the router's steps): the router's joined key splits weighted (O3EDGE_ROUTER_JOINED=WF,WC:
# a 128-key compressed tile counted as 1.5 full-precision tiles, after call 2 found three compressed tiles a
# program slower than two full-precision and one compressed), joined with 64-key compressed tiles, and joined at
# 80 registers a thread (24 splits, six programs an SM): the
# kernels alone at the trained model's shape (tools/bench_attention.py --shape ref-long, 16 x 3,840; int8-0.73 is
# the trained model's share of compressed blocks), then whole decode on the trained model (tools/bench_router.py,
# one round a process, alternating); tokens per joule at batch 1 with every linear INT4 (issue 12), the default
# twice and O3EDGE_GEMV_X_AHEAD=0 alone once. Everything goes into one archive (at most 8 files come back).
# CALL_LIMIT_S (default 560): the call's time limit, from which the last start of each part is reckoned.
set -x
LIMIT=${CALL_LIMIT_S:-560}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
cp docs/results/gpu-2026-12-05e/call1.sh $R/commands.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
cat $R/machine.txt
pack() { tar czf $OUT/call1.tgz -C $R .; }  # after each part: what is done comes back if the call is cut
timeout 150 python3 -m pytest -v -m gpu tests/engine/test_router_graph.py tests/engine/test_router.py -k "graph or joined" -p no:cacheprovider > $R/tests.log 2>&1
tail -n 1 $R/tests.log
attn() {  # name, extra arguments (one word), then environment assignments
  name=$1; extra=$2; shift 2
  [ $SECONDS -gt $((LIMIT * 3 / 4)) ] && { echo "skip $name at ${SECONDS}s"; return; }
  env "$@" timeout 60 python3 tools/bench_attention.py --shape ref-long --batch 16 --context 3840 \
    --cases off,int8-0.73,int8-half,int8 $extra --json $R/attn-$name.json > $R/attn-$name.log 2>&1
  echo "$name: $(grep -E '^(off|int8[a-z0-9.-]*): planned' $R/attn-$name.log | sed 's/ (.*GB\/s); best/ best/' | paste -sd' ') at ${SECONDS}s"
  grep -oE '"case": "int8-0.73", "splits": [0-9]+, "config": [^,]*(, [0-9]+)*\]?, "us": [0-9.]+' $R/attn-$name.log | paste -sd' '
  pack
}
attn default --splits=24 O3EDGE_NOTHING=1
attn joined23 --splits=24 O3EDGE_ROUTER_JOINED=2,3
attn joined11-nreg80 --splits=24 O3EDGE_ROUTER_JOINED=1 O3EDGE_ROUTER_MAXNREG=80
attn joined23-nreg80 --splits=24 O3EDGE_ROUTER_JOINED=2,3 O3EDGE_ROUTER_MAXNREG=80
run() {  # name, then environment assignments
  name=$1; shift
  [ $SECONDS -gt $((LIMIT * 7 / 10)) ] && { echo "skip $name at ${SECONDS}s"; return; }
  env "$@" timeout 60 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 1 \
    --only off,router-int8 --json $R/router-$name.json > $R/router-$name.log 2>&1
  python3 - $R/router-$name.json $name <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))["results"]
off, rt = d["off (CUDA graphs)"], d["router-int8 (CUDA graphs)"]
print(sys.argv[2], "ratio", round(rt["decode_tokens_per_s"] / off["decode_tokens_per_s"], 3), "replay",
      off["graph_replay_ms"], rt["graph_replay_ms"], "steps", {k: v["median_ms"] for k, v in rt["by_kind"].items()})
PY
  pack
}
run default-1 O3EDGE_NOTHING=1
run joined23-1 O3EDGE_ROUTER_JOINED=2,3
[ $SECONDS -lt $((LIMIT * 6 / 10)) ] && timeout 100 python3 tools/profile_router_step.py --trace --shape model --context 3840 \
  --batch 16 --setting router-int8 --json $R/trace-router-int8.json > $R/trace-router-int8.log 2>&1 && python3 - $R/trace-router-int8.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print({k: v["wall_ms"] for k, v in d["by_kind_median_ms"].items()})
for k, v in d["gpu_kernels_per_decode_step"].items():
    if v["calls"] < 0.9:
        print(k[:70], round(v["ms"] / v["calls"], 4), "ms a call")
PY
pack
run default-2 O3EDGE_NOTHING=1
run joined23-2 O3EDGE_ROUTER_JOINED=2,3
run joined23-persm6 O3EDGE_ROUTER_JOINED=2,3 O3EDGE_ROUTER_MAXNREG=80 O3EDGE_ROUTER_PER_SM=6
i=0
for v in base O3EDGE_GEMV_X_AHEAD=0 base; do
  i=$((i+1))
  [ $SECONDS -gt $((LIMIT * 17 / 20)) ] && { echo "skip tokj $i at ${SECONDS}s"; continue; }
  env $([ "$v" = base ] || echo $v) timeout 75 python3 tools/bench_gpu.py --shape tinyllama-1.1b --dtype float16 --int4-all \
    --skip-base --batches 1 --skip-hf --json $R/tokj-$i.json > $R/tokj-$i.log 2>&1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['systems']['o3edge INT4 (all linears)']; b=r['b1']; print(sys.argv[2], round(b['tok_s']), round(b['tok_j'],3), round(b['tok_s']/b['tok_j']), 'W ttft', round(r['ttft_ms'],2))" $R/tokj-$i.json "$v" || tail -n 3 $R/tokj-$i.log
  pack
done
echo "done at ${SECONDS}s"
