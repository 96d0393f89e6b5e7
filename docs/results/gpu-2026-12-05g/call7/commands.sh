# call 7 (prepared in the twenty-third session, 2026-12-05, for the next one; any H100 or H200): with fine tiles the
# router's decode attention compiles for sm_90 to 96 registers uncapped and to 88 with no spill
# (python tools/kernel_sass.py router --shape ref-long --batch 16 --context 3840 --splits 24 --mode int8-0.73
# --dtype bfloat16 --env O3EDGE_ROUTER_MAXNREG=R: 80 spills 8 bytes, 72 40, 64 72), while the cap of 104 holds it
# at four programs an SM (16 splits at 16 x 2 KV heads). Full precision's kernel takes 72 registers (seven an SM,
# 32 splits). And with PDL off the router's kernels in a step sum below full precision's (call 6), with PDL on its
# graph replays 0.020-0.022 ms longer. So: (1) the kernels alone at more programs an SM (O3EDGE_ROUTER_PER_SM with
# the cap that lets them fit), (2) the GPU step alone (graph replay) of both settings with PDL on and off, and with
# the best-looking cap, (3) a refresh's routing in kernels/route.py's kernels (O3EDGE_ROUTER_FUSED_ROUTE=1, made under
# the interpreter, never run on a GPU): whole decode beside the default, (4) GPU tests of both. One archive
# (tools/gpu_call.sh).
NAME=call7 . tools/gpu_call.sh "$0"
attn() {  # name, then environment assignments
  name=$1; shift
  [ $SECONDS -gt $((LIMIT - 45)) ] && { echo "skip attn $name at ${SECONDS}s"; return; }
  env "$@" timeout 60 python3 tools/bench_attention.py --shape ref-long --batch 16 --context 3840 \
    --cases off,int8-0.73,int4-0.73 --json $R/attn-$name.json > $R/attn-$name.log 2>&1
  echo "attn $name: $(grep -E 'planned' $R/attn-$name.log | sed 's/; best.*//' | paste -sd' ') at ${SECONDS}s"
  pack
}
attn default O3EDGE_NOTHING=1
attn sm5-r88 O3EDGE_ROUTER_PER_SM=5 O3EDGE_ROUTER_MAXNREG=88
attn sm6-r80 O3EDGE_ROUTER_PER_SM=6 O3EDGE_ROUTER_MAXNREG=80
attn sm7-r72 O3EDGE_ROUTER_PER_SM=7 O3EDGE_ROUTER_MAXNREG=72
run() {  # name, then environment assignments: one round, for the GPU steps alone (graph_replay_ms)
  name=$1; shift
  [ $SECONDS -gt $((LIMIT - 70)) ] && { echo "skip $name at ${SECONDS}s"; return; }
  env "$@" timeout 90 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 1 \
    --only off,router-int8 --json $R/router-$name.json > $R/router-$name.log 2>&1
  python3 - $R/router-$name.json $name <<'PY'
import json, sys
res = json.load(open(sys.argv[1]))["results"]
off, rt = res["off (CUDA graphs)"], res["router-int8 (CUDA graphs)"]
print(sys.argv[2], "ratio", round(rt["decode_tokens_per_s"] / off["decode_tokens_per_s"], 3), "replay",
      off["graph_replay_ms"], rt["graph_replay_ms"], "steps", {k: v["median_ms"] for k, v in rt["by_kind"].items()})
PY
  pack
}
run default O3EDGE_NOTHING=1
run nopdl O3EDGE_PDL=0
run sm5-r88 O3EDGE_ROUTER_PER_SM=5 O3EDGE_ROUTER_MAXNREG=88
run fused-route O3EDGE_ROUTER_FUSED_ROUTE=1
run sm6-r80 O3EDGE_ROUTER_PER_SM=6 O3EDGE_ROUTER_MAXNREG=80
[ $SECONDS -lt $((LIMIT - 120)) ] && O3EDGE_ROUTER_PER_SM=5 O3EDGE_ROUTER_MAXNREG=88 timeout 110 python3 -m pytest -q -m gpu \
  tests/engine/test_router_graph.py tests/engine/test_router.py tests/engine/test_route_kernels.py \
  -k "graph or many_splits or route" -p no:cacheprovider > $R/tests.log 2>&1
tail -n 2 $R/tests.log
pack
echo "done at ${SECONDS}s"
