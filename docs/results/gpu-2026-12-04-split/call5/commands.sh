#!/bin/bash
# GPU call 5: the INT4 attention projections' new one-row tilings: whole generations (every linear INT4), GPU gemv tests
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,clocks.current.sm,power.draw --format=csv > $OUT/machine.txt
t0=$(date +%s)
python3 tools/bench_gpu.py --shape tinyllama-1.1b --dtype float16 --int4 --int4-all --batches 1 --skip-hf --json $OUT/gen-tiny.json > $OUT/gen.log 2>&1
echo "gen $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gemv.py > $OUT/tests.log 2>&1
echo "end $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
grep -A6 "^| system" $OUT/gen.log; tail -2 $OUT/tests.log
