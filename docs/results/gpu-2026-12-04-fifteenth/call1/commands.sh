# call 1 (2026-12-04 fifteenth session): the one-row decode paths prepared on the CPU (issue 12) and the router's
# flush timed step by step in place (issue 15)
# O3EDGE_ATTN_ARRIVE, O3EDGE_ATTN_ARRIVE_TILE and O3EDGE_SILU_ONE_ROW switched code tried in this session and not kept
# (kernels/arrival.py's docstring, docs/benchmarks.md); the rest runs on the commit that holds these results
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $OUT/machine.txt
# 1. the new kernels compiled, against their references (the same tests CI runs under the interpreter)
timeout 200 python3 -m pytest -q -x tests/engine/test_gemv.py -k "one_row_with_silu or silu_in_the_epilogue_is_refused" \
  > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log
timeout 200 python3 -m pytest -q -x tests/engine/test_kernels.py -k "decode_attention or one_row_mlp" >> $OUT/tests.log 2>&1
tail -2 $OUT/tests.log
# the graph engine with both on, against the eager engine and transformers
O3EDGE_ATTN_ARRIVE=1 O3EDGE_SILU_ONE_ROW=1 timeout 200 python3 -m pytest -q -m gpu -x tests/engine/test_gpu.py >> $OUT/tests.log 2>&1
tail -2 $OUT/tests.log
# 2. one layer's attention at one row (µs), today's split + merge against the last arrival's merge
for c in 200 1000 3000; do
  timeout 90 python3 tools/bench_attention.py --shape tinyllama-1.1b --batch 1 --context $c --dtype float16 --cases off,arrive \
    --json $R/attn-b1-$c.json 2>&1 | tail -3
done
# 3. one step's graph replay, each path alone and both
V="O3EDGE_ATTN_ARRIVE=1;O3EDGE_SILU_ONE_ROW=1;O3EDGE_ATTN_ARRIVE=1,O3EDGE_SILU_ONE_ROW=1"
timeout 120 python3 tools/profile_gpu_step.py --shape tinyllama-1.1b --dtype float16 --variants "$V" --json $R/step-fp16.json 2>&1 | tail -8
timeout 120 python3 tools/profile_gpu_step.py --shape tinyllama-1.1b --dtype float16 --int4 --int4-all --variants "$V" --json $R/step-int4all.json 2>&1 | tail -8
# 4. whole generations at batch 1, fp16 and every linear INT4: as it is, both on, twice each, alternating
for r in 1 2; do
  timeout 100 python3 tools/bench_gpu.py --shape tinyllama-1.1b --dtype float16 --int4-all --batches 1 --skip-hf --json $R/gen-base-$r.json 2>&1 | grep -E '^o3edge'
  O3EDGE_ATTN_ARRIVE=1 O3EDGE_SILU_ONE_ROW=1 timeout 100 python3 tools/bench_gpu.py --shape tinyllama-1.1b --dtype float16 --int4-all --batches 1 --skip-hf --json $R/gen-new-$r.json 2>&1 | grep -E '^o3edge'
done
# 5. issue 15: a refresh's flush, its steps timed in place after the books
timeout 60 python3 tools/bench_demotions.py --mode int8 --repeat 40 --profile --json $R/demotions-int8.json > $R/demotions-int8.log 2>&1
tail -3 $R/demotions-int8.log
tar czf $OUT/call1.tar.gz -C $OUT r && rm -rf $R
