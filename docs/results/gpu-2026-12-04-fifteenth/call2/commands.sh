# call 2 (2026-12-04 fifteenth session): the last-arrival merge with the split tiles of today (64 and 128 keys on 4
# warps) instead of one 256-key program; SiLU in gate/up's epilogue at one row in whole generations (tokens per
# joule); INT4 at prefill size (128 rows) on tiles against dequantize + cuBLAS
# O3EDGE_ATTN_ARRIVE, O3EDGE_ATTN_ARRIVE_TILE and O3EDGE_SILU_ONE_ROW switched code tried in this session and not kept
# (kernels/arrival.py's docstring, docs/benchmarks.md); the rest runs on the commit that holds these results
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
# 1. one layer's attention at one row (µs): split + merge kernel, last arrival on 64-, 128- and 256-key tiles
for c in 200 1000; do
  timeout 90 python3 tools/bench_attention.py --shape tinyllama-1.1b --batch 1 --context $c --dtype float16 --cases off,arrive \
    --configs '[[64,4,2],[128,4,2]]' --json $R/attn-b1-$c.json 2>&1 | grep -E '"arrive"|planned'
done
# 2. one step's graph replay
V="O3EDGE_SILU_ONE_ROW=1;O3EDGE_ATTN_ARRIVE=1,O3EDGE_ATTN_ARRIVE_TILE=64;O3EDGE_ATTN_ARRIVE=1,O3EDGE_ATTN_ARRIVE_TILE=128"
for x in "" "--int4 --int4-all"; do
  timeout 120 python3 tools/profile_gpu_step.py --shape tinyllama-1.1b --dtype float16 $x --variants "$V" \
    --json $R/step${x:+-int4all}.json 2>&1 | grep 'graph replay'
done
# 3. whole generations at batch 1, every linear INT4: as it is and with SiLU in gate/up's epilogue, alternating
for r in 1 2; do
  for s in 0 1; do
    O3EDGE_SILU_ONE_ROW=$s timeout 90 python3 tools/bench_gpu.py --shape tinyllama-1.1b --dtype float16 --int4-all --batches 1 \
      --skip-hf --json $R/gen-silu$s-$r.json 2>&1 | grep -E '^o3edge INT4'
  done
done
# 4. INT4 at prefill size
timeout 170 python3 tools/bench_gemv.py --shapes tinyllama-1.1b --rows 128 --weights int4 --grid --layers qkv,o,gate_up,down \
  --json $R/gemv-prefill.json 2>&1 | grep -E '^best|fused'
tar czf $OUT/call2.tar.gz -C $OUT r && rm -rf $R
