# run on 2026-12-05 at 01:38 UTC as this folder's call 1, as prepared (O3EDGE_ROUTER_MOVE_GRAPH=1 was then the switch that turned the graph on)
# planned call 1 of 2 (prepared in the sixteenth session, 2026-12-04; no GPU was lent that session): the token
# router's demotions by one CUDA graph replay (O3EDGE_ROUTER_MOVE_GRAPH=1, kv_quantize.MoveGraph): the kernels compiled
# and the graph captured, the router's graph path with it on, a refresh's demotions alone with it off and on, and
# one round of whole decode on the trained model each way (call2-planned.sh: more rounds, and spreading)
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; lscpu | grep -E "Model name|^CPU\(s\)") > $R/machine.txt
timeout 100 python3 -m pytest -q -x tests/engine/test_kv_quantize.py > $R/tests-kv-quantize.log 2>&1; tail -1 $R/tests-kv-quantize.log
O3EDGE_ROUTER_MOVE_GRAPH=1 timeout 150 python3 -m pytest -q -x -m gpu tests/engine/test_router_graph.py > $R/tests-router-graph.log 2>&1
tail -1 $R/tests-router-graph.log
# a refresh's 170 demotions alone: books, the flush's host time, the flush until the device is done
for g in 0 1; do
  O3EDGE_ROUTER_MOVE_GRAPH=$g timeout 45 python3 tools/bench_demotions.py --mode int8 --repeat 40 --json $R/demotions-graph$g.json | tail -1
done
# whole decode at 16 x 3,840 on the trained model, full precision beside in each process
for g in 0 1; do
  O3EDGE_ROUTER_MOVE_GRAPH=$g timeout 100 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 \
    --rounds 2 --only off,router-int8 --json $R/router-graph$g-1.json 2>&1 | grep -E "x of full" | tail -2
done
tar czf $OUT/call1.tar.gz -C $OUT r && rm -rf $R
