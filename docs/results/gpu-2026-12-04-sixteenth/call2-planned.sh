# planned call 2 of 2 (sixteenth session, 2026-12-04; run after call1-planned.sh passes its tests): whole decode on
# the trained model with the router's move graph off and on once more, and with a refresh's demotions spread over 4
# steps (spreading lost on the H200 when each share paid a flush's fixed host cost: docs/benchmarks.md, 2026-12-02 18:08)
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $R/machine.txt
for g in 1 0; do
  O3EDGE_ROUTER_MOVE_GRAPH=$g timeout 120 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 \
    --rounds 2 --only off,router-int8 --json $R/router-graph$g-2.json 2>&1 | grep -E "x of full" | tail -2
done
O3EDGE_ROUTER_MOVE_GRAPH=1 O3EDGE_ROUTER_DEMOTION_STEPS=4 timeout 120 python3 tools/bench_router.py --gpu --shape model \
  --context 3840 --batch 16 --rounds 2 --only off,router-int8 --json $R/router-graph1-spread4.json 2>&1 | grep -E "x of full" | tail -2
tar czf $OUT/call2.tar.gz -C $OUT r && rm -rf $R
