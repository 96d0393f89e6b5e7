# call 12 (twenty-fourth session, 2026-12-05; any H100 or H200): the INT4 router and uniform INT8 and INT4 KV beside
# full precision in the same run (the issue asks every figure beside them), two processes of three rounds.
NAME=call12 . tools/gpu_call.sh "$0"
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
for p in 1 2; do
  [ $SECONDS -gt $((LIMIT - 150)) ] && { echo "skip decode $p at ${SECONDS}s"; break; }
  timeout 150 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 3 \
    --thresholds 0.3 --only off,uniform-int8,uniform-int4,router-int8,router-int4,router-int8-t0.3,router-int4-t0.3 \
    --json $R/router-$p.json > $R/router-$p.log 2>&1
  echo "decode $p at ${SECONDS}s"; summary $R/router-$p.json
  pack
done
echo "done at ${SECONDS}s"
