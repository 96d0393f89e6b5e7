# planned call 5 (2026-12-05; not run: the session's device time was spent): the router decode kernel's tiling on the
# trained model, where each program reads ~240 keys (16 sequences x 2 KV heads, 16 key splits) and the router's GPU
# step alone is 0.331-0.337 ms against full precision's 0.302 (calls 1-4). Each run: whole decode, full precision
# and router INT8 in one process, each setting's GPU step alone (graph_replay_ms). Switches, one at a time:
# three stages of loads in flight; compressed tiles of two blocks (shorter, more iterations to pipeline); full
# precision's tiles of 32 keys; no register cap (three programs an SM); the first-round code paths (a control).
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
run() {  # name, then environment assignments
  name=$1; shift
  env "$@" timeout 60 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 1 \
    --only off,router-int8 --json $R/router-$name.json > $R/router-$name.log 2>&1
  echo "$name: $(grep -oE "'(graph_replay|step)_ms(_p50)?': [0-9.]+|'decode_tokens_per_s': [0-9.]+" $R/router-$name.log | paste -sd' ')"
}
run stages3 O3EDGE_ROUTER_TILING=64,128,4,3
run ctile64 O3EDGE_ROUTER_TILING=64,64,4,2
run full32 O3EDGE_ROUTER_TILING=32,128,4,2
run nocap O3EDGE_ROUTER_MAXNREG=0 O3EDGE_ROUTER_PER_SM=3
run first O3EDGE_ROUTER_FAST=0
# added in the nineteenth session: six programs an SM (24 key splits) where the kernel fits 80 registers, compiled for
# sm_90 on the CPU machine (tools/kernel_sass.py router --shape ref-long --splits 16 --dtype bfloat16 --env ...):
# 64-key full tiles and two-block compressed tiles capped at 80 (8 bytes spilled), or 32-key tiles and one-block
# compressed tiles (80 registers uncapped, none spilled); the default: 104 capped (24 spilled), full precision's 72
run persm6-ctile64 O3EDGE_ROUTER_TILING=64,64,4,2 O3EDGE_ROUTER_MAXNREG=80 O3EDGE_ROUTER_PER_SM=6
run persm6-tile32 O3EDGE_ROUTER_TILING=32,32,4,2 O3EDGE_ROUTER_MAXNREG=0 O3EDGE_ROUTER_PER_SM=6
