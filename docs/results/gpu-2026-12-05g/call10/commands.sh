# call 10 (twenty-fourth session, 2026-12-05; any H100 or H200): call 9's whole decode again on another machine
# (the refresh cycle's host work moved 3x between calls 8 and 9), three processes of three rounds, and the
# router graph's GPU tests with a refresh's routing in kernels by default.
NAME=call10 . tools/gpu_call.sh "$0"
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
for p in 1 2 3; do
  [ $SECONDS -gt $((LIMIT - 150)) ] && { echo "skip decode $p at ${SECONDS}s"; break; }
  timeout 190 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 3 \
    --thresholds 0.3 --refresh-steps 64 --only off,router-int8,router-int8-t0.3,router-int8-t0.3-refresh64 \
    --json $R/router-$p.json > $R/router-$p.log 2>&1
  echo "decode $p at ${SECONDS}s"; summary $R/router-$p.json
  pack
done
[ $SECONDS -lt $((LIMIT - 100)) ] && timeout $((LIMIT - SECONDS - 20)) python3 -m pytest -q -m gpu \
  tests/engine/test_router_graph.py tests/engine/test_route_kernels.py -p no:cacheprovider > $R/tests.log 2>&1
tail -n 2 $R/tests.log
pack
echo "done at ${SECONDS}s"
