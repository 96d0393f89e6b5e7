# call 3 (2026-12-05): the router's move graph now on by default (its GPU tests), whole decode on the trained model
# with it off and on once more and with a refresh's demotions spread over 4 steps; then tokens per joule at batch 1
# with every linear INT4, the defaults against one switch at a time, alternating (issue 12's last goal)
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
timeout 100 python3 -m pytest -q -x -m gpu tests/engine/test_router_graph.py tests/engine/test_kv_quantize.py > $R/tests.log 2>&1
tail -1 $R/tests.log
for g in 1 0; do
  O3EDGE_ROUTER_MOVE_GRAPH=$g timeout 100 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 \
    --rounds 2 --only off,router-int8 --json $R/router-graph$g.json 2>&1 | grep -E "x of full" | tail -1
done
O3EDGE_ROUTER_DEMOTION_STEPS=4 timeout 100 python3 tools/bench_router.py --gpu --shape model \
  --context 3840 --batch 16 --rounds 2 --only off,router-int8 --json $R/router-spread4.json 2>&1 | grep -E "x of full" | tail -1
i=0
for v in base O3EDGE_PDL=0 O3EDGE_INT4_DP4A=0 base O3EDGE_INT4_DP4A=all O3EDGE_GEMV_X_AHEAD=0 base O3EDGE_ATTN_PREFETCH=0 base; do
  i=$((i+1))
  env $([ $v = base ] || echo $v) timeout 45 python3 tools/bench_gpu.py --shape tinyllama-1.1b --dtype float16 --int4-all \
    --skip-base --batches 1 --skip-hf --json $R/tokj-$i-$v.json > /dev/null 2>&1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['systems']['o3edge INT4 (all linears)']; b=r['b1']; print(sys.argv[2], round(b['tok_s']), round(b['tok_j'],3), round(b['tok_s']/b['tok_j']), 'W ttft', round(r['ttft_ms'],2))" $R/tokj-$i-$v.json $v
done
tar czf $OUT/call3.tar.gz -C $OUT r && rm -rf $R
