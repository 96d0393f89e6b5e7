#!/bin/bash
# GPU call 2: activations a tile ahead (X_AHEAD) and llama-1b's INT4 down split in four on dp4a
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,clocks.current.sm,power.draw --format=csv > $OUT/machine.txt
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/engine/test_gemv.py -k "split_along or planned or streamed_int4_row or several_tiles" > $OUT/tests.log 2>&1
echo "tests $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
for xa in 1 0; do
O3EDGE_GEMV_X_AHEAD=$xa python3 tools/bench_gemv.py --rows 1 --weights all --layers down --json $OUT/down-xa$xa.json >> $OUT/gemv.log 2>&1
done
python3 tools/bench_gemv.py --rows 1 --weights dense --layers down --grid --json $OUT/grid-dense-xa1.json >> $OUT/gemv.log 2>&1
GRID_SPLITS=1,4 python3 tools/bench_gemv.py --rows 1 --weights int4 --layers down --grid --json $OUT/grid-int4-xa1.json >> $OUT/gemv.log 2>&1
echo "gemv $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
V="O3EDGE_GEMV_X_AHEAD=0;O3EDGE_GEMV_SPLIT=0;O3EDGE_GEMV_X_AHEAD=0,O3EDGE_GEMV_SPLIT=0;O3EDGE_GEMV_X_AHEAD=1"
python3 tools/profile_gpu_step.py --shape llama-1b --dtype bfloat16 --int4 --variants "$V" --json $OUT/prof-llama1b-int4.json > $OUT/prof.log 2>&1
python3 tools/profile_gpu_step.py --shape tinyllama-1.1b --dtype float16 --int4 --variants "$V" --json $OUT/prof-tiny-int4.json >> $OUT/prof.log 2>&1
python3 tools/profile_gpu_step.py --shape tinyllama-1.1b --dtype float16 --variants "O3EDGE_GEMV_X_AHEAD=0;O3EDGE_GEMV_X_AHEAD=1;O3EDGE_GEMV_X_AHEAD=0" --json $OUT/prof-tiny-fp16.json >> $OUT/prof.log 2>&1
echo "end $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
tail -2 $OUT/tests.log
