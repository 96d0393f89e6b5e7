# run on 2026-12-05 at 01:41 UTC as this folder's call 2, as prepared (O3EDGE_INT4_PREFILL_TILES=1 was then the switch that turned the tiles on)
# planned call (prepared in the fifteenth session, 2026-12-04; no GPU was lent for it), run with O3EDGE_INT4_PREFILL_TILES as named: INT4 prompt chunks of 65-128 rows on tiles (gemv.prefill_tiling): the tests
# compiled, time to first token against dequantize + cuBLAS (O3EDGE_INT4_PREFILL_TILES=0), and the rule on llama-1b's
# shapes
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
timeout 120 python3 -m pytest -q -x tests/engine/test_kernels.py -k "int4_matmul or prompt_chunks" > $R/tests.log 2>&1
tail -1 $R/tests.log
for t in 0 1; do
  O3EDGE_INT4_PREFILL_TILES=$t timeout 80 python3 tools/bench_gpu.py --shape tinyllama-1.1b --dtype float16 --int4-all \
    --batches 1 --skip-hf --json $R/gen-tiles$t.json 2>&1 | grep -E '^o3edge'
done
for t in 1 0; do
  O3EDGE_INT4_PREFILL_TILES=$t timeout 60 python3 tools/bench_gemv.py --shapes llama-1b --rows 128 --weights int4 \
    --layers gate_up,down --json $R/gemv-prefill-tiles$t.json 2>&1 | grep -E 'fused'
done
tar czf $OUT/call3.tar.gz -C $OUT r && rm -rf $R
