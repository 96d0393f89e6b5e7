# call 1 (2026-12-05, twenty-first session): the twentieth session's work on the GPU (it had none: thirteen starts
# failed) and this session's joined key splits, in one call (files go to $OUT as they are made; later parts are
# skipped when the call's time runs short):
# 1. the router's graph tests on CUDA (a refresh's route graph now splitting the observing step's entries into the
#    pools and finding the demotions, 125b3ec) and the joined splits' kernel tests (O3EDGE_ROUTER_JOINED=1);
# 2. the trained model's router against full precision in one process (tools/bench_router.py, one round a
#    process), the default and O3EDGE_ROUTER_JOINED=1 alternating, two processes each: whole decode and each
#    setting's GPU step alone (graph_replay_ms);
# 3. joined with the six-programs-an-SM tiling (tools/kernel_sass.py: 80 registers) and with two-block compressed
#    tiles;
# 4. tokens per joule at batch 1 with every linear INT4 (issue 12's last goal, >= 5), the defaults alternating with
#    O3EDGE_GEMV_X_AHEAD=0 O3EDGE_ATTN_PREFETCH=0 (each alone lowered the board's power in the seventeenth session).
# CALL_LIMIT_S (default 600): the call's time limit, from which each part's last start is reckoned.
set -x
LIMIT=${CALL_LIMIT_S:-600}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
timeout 110 python3 -m pytest -v -m gpu tests/engine/test_router_graph.py tests/engine/test_router.py -k "graph or joined" \
  -p no:cacheprovider > $R/tests-router.log 2>&1
grep -cE 'PASSED' $R/tests-router.log; grep -E 'FAILED|ERROR' $R/tests-router.log | head; tail -n 1 $R/tests-router.log
run() {  # name, then environment assignments
  name=$1; shift
  [ $SECONDS -gt $((LIMIT * 4 / 5)) ] && { echo "skip $name at ${SECONDS}s"; return; }
  env "$@" timeout 70 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 1 \
    --only off,router-int8 --json $R/router-$name.json > $R/router-$name.log 2>&1
  echo "$name: $(grep -oE "'(graph_replay|step)_ms(_p50)?': [0-9.]+|'decode_tokens_per_s': [0-9.]+|[0-9.]+x of full" $R/router-$name.log | paste -sd' ') at ${SECONDS}s"
}
run default-1 O3EDGE_NOTHING=1
run joined-1 O3EDGE_ROUTER_JOINED=1
run joined-2 O3EDGE_ROUTER_JOINED=1
run default-2 O3EDGE_NOTHING=1
run joined-persm6-ctile64 O3EDGE_ROUTER_JOINED=1 O3EDGE_ROUTER_TILING=64,64,4,2 O3EDGE_ROUTER_MAXNREG=80 O3EDGE_ROUTER_PER_SM=6
run joined-ctile64 O3EDGE_ROUTER_JOINED=1 O3EDGE_ROUTER_TILING=64,64,4,2
i=0
for v in base "O3EDGE_GEMV_X_AHEAD=0 O3EDGE_ATTN_PREFETCH=0"; do
  i=$((i+1))
  [ $SECONDS -gt $((LIMIT * 9 / 10)) ] && { echo "skip tokj $i at ${SECONDS}s"; continue; }
  env $([ "$v" = base ] || echo $v) timeout 45 python3 tools/bench_gpu.py --shape tinyllama-1.1b --dtype float16 --int4-all \
    --skip-base --batches 1 --skip-hf --json $R/tokj-$i.json > $R/tokj-$i.log 2>&1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['systems']['o3edge INT4 (all linears)']; b=r['b1']; print(sys.argv[2], round(b['tok_s']), round(b['tok_j'],3), round(b['tok_s']/b['tok_j']), 'W ttft', round(r['ttft_ms'],2))" $R/tokj-$i.json "$v"
done
echo "done at ${SECONDS}s"
