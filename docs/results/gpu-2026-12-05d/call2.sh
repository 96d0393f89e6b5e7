# call 2 (2026-12-05, twenty-first session, the same warm H100 as call 1): where the router's GPU step loses to full
# precision's on the trained model (0.327 ms against 0.300 with joined splits, call 1): the two settings' decode
# steps traced (torch.profiler: the GPU's time a step by kernel), the router with O3EDGE_ROUTER_JOINED=1; the two
# kernels alone at the trained model's shape (tools/bench_attention.py --shape ref-long, 16 x 3,840), default and
# joined splits; tokens per joule at batch 1 (every linear INT4), whose default run call 1 lost to its 45 s limit.
# Everything goes into one archive (at most 8 files come back).
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
ls /root/out 2>/dev/null | head -3
for s in off router-int8; do
  O3EDGE_ROUTER_JOINED=1 timeout 100 python3 tools/profile_router_step.py --trace --shape model --context 3840 --batch 16 \
    --setting $s --json $R/trace-$s.json > $R/trace-$s.log 2>&1
  grep -iE -A14 "by kernel" $R/trace-$s.log | head -30
done
for j in 0 1; do
  O3EDGE_ROUTER_JOINED=$j timeout 100 python3 tools/bench_attention.py --shape ref-long --batch 16 --context 3840 \
    --cases off,int8,int8-half,int4 --splits 8,12,16,24 --json $R/attn-joined$j.json > $R/attn-joined$j.log 2>&1
  tail -n 14 $R/attn-joined$j.log
done
i=0
for v in base "O3EDGE_GEMV_X_AHEAD=0 O3EDGE_ATTN_PREFETCH=0" base; do
  i=$((i+1))
  [ $SECONDS -gt 500 ] && { echo "skip tokj $i at ${SECONDS}s"; continue; }
  env $([ "$v" = base ] || echo $v) timeout 80 python3 tools/bench_gpu.py --shape tinyllama-1.1b --dtype float16 --int4-all \
    --skip-base --batches 1 --skip-hf --json $R/tokj-$i.json > $R/tokj-$i.log 2>&1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['systems']['o3edge INT4 (all linears)']; b=r['b1']; print(sys.argv[2], round(b['tok_s']), round(b['tok_j'],3), round(b['tok_s']/b['tok_j']), 'W ttft', round(r['ttft_ms'],2))" $R/tokj-$i.json "$v" || tail -n 5 $R/tokj-$i.log
done
cp docs/results/gpu-2026-12-05d/call2.sh $R/commands.sh; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $R/machine.txt
tar czf $OUT/call2.tgz -C $R .
echo "done at ${SECONDS}s"
