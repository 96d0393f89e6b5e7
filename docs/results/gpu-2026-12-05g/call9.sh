# call 9 (twenty-fourth session, 2026-12-05; any H100 or H200). A refresh's routing in kernels is the default now
# (call 8: its GPU tests passed, the step after a refresh shorter). (1) Where the router's GPU step loses ~0.02 ms
# to full precision's although its attention kernel alone is no slower: each setting's last graph step replayed
# 200 times under the profiler (tools/profile_router_step.py --replays), kernel by kernel and the gaps between
# them. (2) Whole decode of the trained model at 16 x 3,840, three rounds a process in two processes: full
# precision, the default router (threshold 0.85), the router at threshold 0.3 (4 sink, 32 recent tokens: the
# setting that meets the byte and quality goals), and that one refreshing every 64 steps.
NAME=call9 . tools/gpu_call.sh "$0"
for s in off router-int8 router-int8-t0.3; do
  [ $SECONDS -gt $((LIMIT - 60)) ] && break
  timeout 80 python3 - $s > $R/replays-$s.log 2>&1 <<'PY'
import sys
sys.path.insert(0, "tools")
import bench_router, profile_router_step
bench_router.SETTINGS["router-int8-t0.3"] = dict(kv_router="int8", router_threshold=0.3, sink_tokens=4, recent_tokens=32)
s = sys.argv[1]
sys.argv = ["profile_router_step.py", "--setting", s, "--shape", "model", "--context", "3840", "--batch", "16",
            "--replays", "200", "--json", f"/tmp/r/replays-{s}.json"]
profile_router_step.main()
PY
  python3 - $R/replays-$s.json $s <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for g in ("graph", "observing graph"):
    if g in d:
        k = list(d[g]["kernels"].items())[:6]
        print(sys.argv[2], g, "events", d["timed_by_events"], "span", d[g]["span_ms"], "busy", d[g]["busy_ms"],
              [(n[:28], v["calls"], v["ms"]) for n, v in k])
PY
  pack
done
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
  timeout 190 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 3 \
    --thresholds 0.3 --refresh-steps 64 --only off,router-int8,router-int8-t0.3,router-int8-t0.3-refresh64 \
    --json $R/router-$p.json > $R/router-$p.log 2>&1
  echo "decode $p at ${SECONDS}s"; summary $R/router-$p.json
  pack
done
echo "done at ${SECONDS}s"
