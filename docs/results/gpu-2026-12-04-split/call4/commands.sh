#!/bin/bash
# GPU call 4: one-row tilings of the attention projections (QKV with its norm prologue, o), INT4 on dp4a and dense, split along K or not
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,clocks.current.sm,power.draw --format=csv > $OUT/machine.txt
t0=$(date +%s)
export GRID_SPLITS=1,2
python3 tools/bench_gemv.py --rows 1 --weights int4 --layers qkv,o --grid --json $OUT/grid-int4-attn.json > $OUT/grid.log 2>&1
echo "int4 $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
python3 tools/bench_gemv.py --rows 1 --weights dense --layers qkv,o --grid --json $OUT/grid-dense-attn.json >> $OUT/grid.log 2>&1
echo "end $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
grep "fused\|^best" $OUT/grid.log
