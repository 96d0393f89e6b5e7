#!/bin/bash
# GPU call 3: GPU gemv tests (llama-1b's split down included), whole generations at batch 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,clocks.current.sm,power.draw --format=csv > $OUT/machine.txt
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gemv.py > $OUT/tests.log 2>&1
echo "tests $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
python3 tools/bench_gpu.py --shape llama-1b --dtype bfloat16 --int4 --int4-head --batches 1 --skip-hf --json $OUT/gen-llama1b.json > $OUT/gen.log 2>&1
echo "llama1b $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
python3 tools/bench_gpu.py --shape tinyllama-1.1b --dtype float16 --int4 --int4-all --batches 1 --skip-hf --json $OUT/gen-tiny.json >> $OUT/gen.log 2>&1
echo "end $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
tail -2 $OUT/tests.log; grep -i "tok/s\|ms a step\|tok/J" $OUT/gen.log | tail -20
