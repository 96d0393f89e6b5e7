# call 3 (2026-12-04 fourteenth session): the seventeenth llama.cpp round, today's defaults; one-step profiles of
# tinyllama fp16 and every linear INT4 at batch 1 while llama.cpp builds (graph replays: the build's CPU load does
# not touch them)
(nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv; lscpu | grep -E "Model name|^CPU\(s\)") > $OUT/machine.txt
export PYTHONPATH=/tmp/site:$PWD
VARIANTS="--int4 --int4-all" GEMV=0 PROFILE=0 \
DURING_BUILD="python3 tools/profile_gpu_step.py --shape tinyllama-1.1b --dtype float16 --variants '' --json $OUT/profile-tiny-fp16.json 2>&1 | grep -v -i warn | tail -4; python3 tools/profile_gpu_step.py --shape tinyllama-1.1b --dtype float16 --int4 --int4-all --variants '' --json $OUT/profile-tiny-int4-all.json 2>&1 | grep -v -i warn | tail -4" \
bash tools/bench_gpu_vs_llamacpp.sh
