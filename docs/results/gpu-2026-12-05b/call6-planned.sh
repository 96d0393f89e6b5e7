# planned call 6 (2026-12-05; not run: the session's device time was spent): tokens per joule at batch 1 with every
# linear INT4 (issue 12's last goal, >= 5), switches combined, alternating with the defaults. The seventeenth session's
# one-at-a-time grid (docs/results/gpu-2026-12-05/call3/) had the defaults at 4.866-4.892, O3EDGE_GEMV_X_AHEAD=0 at
# 4.993 (1.9% slower, 4% less power) and O3EDGE_ATTN_PREFETCH=0 at 4.876 (434 W against 441-444).
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
i=0
for v in base O3EDGE_GEMV_X_AHEAD=0 base "O3EDGE_GEMV_X_AHEAD=0 O3EDGE_ATTN_PREFETCH=0" base O3EDGE_GEMV_X_AHEAD=0; do
  i=$((i+1))
  env $([ "$v" = base ] || echo $v) timeout 45 python3 tools/bench_gpu.py --shape tinyllama-1.1b --dtype float16 --int4-all \
    --skip-base --batches 1 --skip-hf --json $R/tokj-$i.json > /dev/null 2>&1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['systems']['o3edge INT4 (all linears)']; b=r['b1']; print(sys.argv[2], round(b['tok_s']), round(b['tok_j'],3), round(b['tok_s']/b['tok_j']), 'W ttft', round(r['ttft_ms'],2))" $R/tokj-$i.json "$v"
done
