# call 8 (twenty-fourth session, 2026-12-05; any H100 or H200). Call 7 found: more programs an SM at a lower
# register cap slower for the router's kernel (INT8 13.06 us a layer at the default, 14.9-17.2 capped); a refresh's
# routing in kernels/route.py's kernels (O3EDGE_ROUTER_FUSED_ROUTE=1) took the step after a refresh from 0.698
# to 0.489 ms with the same 693 demotions, but its GPU test was cut by the call's limit. So: (1) that test, (2)
# whole decode of the trained model at 16 x 3,840, two rounds a process, the route as now and then in kernels,
# beside the router at threshold 0.3 (4 sink, 32 recent tokens: the setting that meets the byte
# goals) and refreshing every 64 steps, (3) the kernel alone at 93% compressed (threshold 0.3's share).
NAME=call8 . tools/gpu_call.sh "$0"
timeout 100 python3 -m pytest -q -m gpu tests/engine/test_route_kernels.py tests/engine/test_router_graph.py \
  -k "route" -p no:cacheprovider > $R/tests.log 2>&1
tail -n 2 $R/tests.log
pack
summary() {  # a bench_router --gpu JSON: each setting's ratio to full precision by round, replay and step kinds
  python3 - "$1" <<'PY'
import json, sys
res = json.load(open(sys.argv[1]))["results"]
for name, r in res.items():
    print(f"  {name}: {r['decode_tokens_per_s']} tok/s, x off {r.get('ratio_to_off_by_round')}, replay "
          f"{r.get('graph_replay_ms')}, kv {r.get('kv_bytes_per_token')}, demoted {r.get('blocks_demoted_in_decode')}, "
          f"steps {({k: v['median_ms'] for k, v in r['by_kind'].items()})}")
PY
}
bench() {  # name, an environment assignment, then arguments for bench_router
  name=$1; setting=$2; shift 2
  [ $SECONDS -gt $((LIMIT - 150)) ] && { echo "skip $name at ${SECONDS}s"; return; }
  env $setting timeout 190 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 2 \
    --thresholds 0.3 --refresh-steps 64 "$@" --json $R/router-$name.json > $R/router-$name.log 2>&1
  echo "$name at ${SECONDS}s"; summary $R/router-$name.json
  pack
}
bench route-ops O3EDGE_NOTHING=1 --only off,router-int8,router-int8-t0.3
bench route-kernels O3EDGE_ROUTER_FUSED_ROUTE=1 --only off,router-int8,router-int8-t0.3,router-int8-refresh64
[ $SECONDS -lt $((LIMIT - 40)) ] && timeout 40 python3 tools/bench_attention.py --shape ref-long --batch 16 \
  --context 3840 --cases off,int8-0.73,int8-0.93,int4-0.93 --json $R/attn.json > $R/attn.log 2>&1
grep planned $R/attn.log | sed 's/; best.*//'
pack
echo "done at ${SECONDS}s"
