# call 14 (prepared in the twenty-fourth session, 2026-12-05, for the next one; an H200 if one comes, else any H100):
# on every machine of the session full precision's ordinary engine step was ~0.025 ms longer than the router's,
# though its GPU step alone is shorter and its host Python work the same on the CPU machine. Two guesses, one
# process each beside the usual order: full precision's place in the round (--off-last runs it last), and its
# graph sampling (O3EDGE_GRAPH_SAMPLING=0: its sampled-row graphs not captured; the router's path has none). Three
# rounds a process, the trained model at 16 x 3,840, the router at the default threshold and at 0.3, uniform INT8;
# then both settings' real decode under the profiler (--trace, PDL on): the GPU's time a step by kernel.
NAME=call14 . tools/gpu_call.sh "$0"
decode() {  # name, an environment assignment, then more arguments for bench_router
  name=$1; setting=$2; shift 2
  [ $SECONDS -gt $((LIMIT - 100)) ] && { echo "skip $name at ${SECONDS}s"; return; }
  env $setting timeout 140 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 3 \
    --thresholds 0.3 --only off,router-int8,router-int8-t0.3,uniform-int8 "$@" --json $R/router-$name.json \
    > $R/router-$name.log 2>&1
  echo "$name at ${SECONDS}s"; tail -n 4 $R/router-$name.log
  pack
}
decode usual O3EDGE_NOTHING=1
decode off-last O3EDGE_NOTHING=1 --off-last
decode no-graph-sampling O3EDGE_GRAPH_SAMPLING=0
decode usual-again O3EDGE_NOTHING=1
for s in off router-int8; do  # the GPU's time a decode step by kernel in a real decode (PDL on), both settings
  [ $SECONDS -gt $((LIMIT - 50)) ] && break
  timeout 45 python3 tools/profile_router_step.py --trace --setting $s --shape model --context 3840 --batch 16 \
    --steps 48 --json $R/trace-$s.json > $R/trace-$s.log 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], d['by_kind_median_ms'].get('other'), \
    [(k[:24], v['ms']) for k, v in list(d['gpu_kernels_per_decode_step'].items())[:6]])" $R/trace-$s.json $s
  pack
done
echo "done at ${SECONDS}s"
