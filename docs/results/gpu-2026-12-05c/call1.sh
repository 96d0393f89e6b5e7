# call 1 (2026-12-05, twentieth session; not run: no device machine could be started): the nineteenth session's
# work on the GPU, which had none lent, and this session's refresh on the device, in one call (files go to $OUT as
# they are made; later parts are skipped when the call's time runs short):
# 1. the router's graph tests on CUDA (its CUDA events on the engine's device's current stream, dddc6e3; a refresh's
#    route graph now splitting the observing step's entries into the pools and finding the demotions, 125b3ec);
# 2. the trained model's router against full precision, three rounds alternating in one process, with the lighter
#    refresh cycle (27472c2, 125b3ec);
# 3. the router kernel's six-programs-an-SM tilings (tools/kernel_sass.py: 80 registers) and two-block compressed
#    tiles, each setting's GPU step alone;
# 4. tokens per joule at batch 1 with every linear INT4 (issue 12's last goal, >= 5), the defaults alternating with
#    the two switches that lowered the board's power in the seventeenth session (O3EDGE_GEMV_X_AHEAD=0 alone: 4.993
#    against 4.866-4.892; O3EDGE_ATTN_PREFETCH=0 alone 4.876), now together;
# 5. the host step with the device stubbed, on this machine's CPU (thread CPU time), both settings.
# CALL_LIMIT_S (default 600): the call's time limit, from which each part's last start is reckoned (450 for a call
# squeezed by the device time left).
set -x
LIMIT=${CALL_LIMIT_S:-600}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
timeout 100 python3 -m pytest -v -m gpu tests/engine/test_router_graph.py -p no:cacheprovider > $R/tests-router-graph.log 2>&1
grep -cE 'PASSED' $R/tests-router-graph.log; grep -E 'FAILED|ERROR' $R/tests-router-graph.log | head; tail -n 1 $R/tests-router-graph.log
timeout 200 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 3 \
  --only off,router-int8 --json $R/router-rounds.json > $R/router-rounds.log 2>&1
grep -E "x of full" $R/router-rounds.log; grep -E "round [0-9]" $R/router-rounds.log | grep -oE "^[a-z0-9-]+|round [0-9]|'by_kind': .*'graph_steps'|'graph_replay_ms': [0-9.]+" | paste -sd' ' | sed 's/ \(off\|router-int8\) /\n\1 /g'
run() {  # name, then environment assignments
  name=$1; shift
  [ $SECONDS -gt $((LIMIT * 3 / 5)) ] && { echo "skip $name at ${SECONDS}s"; return; }
  env "$@" timeout 60 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 1 \
    --only off,router-int8 --json $R/router-$name.json > $R/router-$name.log 2>&1
  echo "$name: $(grep -oE "'(graph_replay|step)_ms(_p50)?': [0-9.]+|'decode_tokens_per_s': [0-9.]+" $R/router-$name.log | paste -sd' ')"
}
run persm6-ctile64 O3EDGE_ROUTER_TILING=64,64,4,2 O3EDGE_ROUTER_MAXNREG=80 O3EDGE_ROUTER_PER_SM=6
run persm6-tile32 O3EDGE_ROUTER_TILING=32,32,4,2 O3EDGE_ROUTER_MAXNREG=0 O3EDGE_ROUTER_PER_SM=6
run ctile64 O3EDGE_ROUTER_TILING=64,64,4,2
i=0
for v in base "O3EDGE_GEMV_X_AHEAD=0 O3EDGE_ATTN_PREFETCH=0" base "O3EDGE_GEMV_X_AHEAD=0 O3EDGE_ATTN_PREFETCH=0"; do
  i=$((i+1))
  [ $SECONDS -gt $((LIMIT * 5 / 6)) ] && { echo "skip tokj $i at ${SECONDS}s"; continue; }
  env $([ "$v" = base ] || echo $v) timeout 45 python3 tools/bench_gpu.py --shape tinyllama-1.1b --dtype float16 --int4-all \
    --skip-base --batches 1 --skip-hf --json $R/tokj-$i.json > $R/tokj-$i.log 2>&1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['systems']['o3edge INT4 (all linears)']; b=r['b1']; print(sys.argv[2], round(b['tok_s']), round(b['tok_j'],3), round(b['tok_s']/b['tok_j']), 'W ttft', round(r['ttft_ms'],2))" $R/tokj-$i.json "$v"
done
for s in off router-int8; do
  [ $SECONDS -gt $((LIMIT * 53 / 60)) ] && { echo "skip host $s at ${SECONDS}s"; continue; }
  O3EDGE_CPU_KERNELS=torch timeout 30 python3 tools/bench_host_step.py --setting $s --batch 16 --context 3840 \
    --steps 128 --repeat 1 --clock thread --json $R/host-$s.json > $R/host-$s.log 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], [(r['mean_ms'], r.get('cycle_extra_ms'), {k: v['median_ms'] for k, v in r['by_kind'].items()}) for r in d['runs']])" $R/host-$s.json
done
echo "done at ${SECONDS}s"
