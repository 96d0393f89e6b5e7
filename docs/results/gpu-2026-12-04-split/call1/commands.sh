#!/bin/bash
# GPU call 1: split streamed rows (the down projection), compiled tests, grids, in-process A/B of the graph step
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,clocks.current.sm,power.draw --format=csv > $OUT/machine.txt
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/engine/test_gemv.py -k "split_along or planned" > $OUT/tests.log 2>&1
echo "tests $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
export GRID_SPLITS=1,2,3,4,6
python3 tools/bench_gemv.py --rows 1 --weights int4 --layers down --grid --json $OUT/grid-int4-dp4a.json > $OUT/grid.log 2>&1
echo "grid1 $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
O3EDGE_INT4_DP4A=0 python3 tools/bench_gemv.py --rows 1 --weights int4 --layers down --grid --json $OUT/grid-int4-packed.json >> $OUT/grid.log 2>&1
echo "grid2 $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
python3 tools/bench_gemv.py --rows 1 --weights dense --layers down --grid --json $OUT/grid-dense.json >> $OUT/grid.log 2>&1
echo "grid3 $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
unset GRID_SPLITS
V="O3EDGE_GEMV_SPLIT=0;O3EDGE_GEMV_SPLIT=1;O3EDGE_GEMV_SPLIT=1,O3EDGE_INT4_DP4A=0"
python3 tools/profile_gpu_step.py --shape tinyllama-1.1b --dtype float16 --int4 --variants "$V" --json $OUT/prof-tiny-int4.json > $OUT/prof.log 2>&1
python3 tools/profile_gpu_step.py --shape llama-1b --dtype bfloat16 --int4 --variants "$V" --json $OUT/prof-llama1b-int4.json >> $OUT/prof.log 2>&1
python3 tools/profile_gpu_step.py --shape tinyllama-1.1b --dtype float16 --variants "O3EDGE_GEMV_SPLIT=0;O3EDGE_GEMV_SPLIT=1" --json $OUT/prof-tiny-fp16.json >> $OUT/prof.log 2>&1
echo "end $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
