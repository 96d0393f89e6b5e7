#!/usr/bin/env bash
# One GPU-machine call: build llama.cpp (CUDA, sm_90) from ../shared/peers/gpu (prepared into .peer/
# by its prepare.sh), then benchmark o3edge and llama.cpp on the same random TinyLlama-1.1B-shaped
# checkpoint, profile one llama-1b decode step, and time the decode matmuls (tools/bench_gemv.py).
# Results land in $OUT (JSON and logs); plot them with
# `python tools/bench_gpu.py --reuse OUT.json --plot PNG` where matplotlib is installed.
#   bash ../shared/peers/gpu/prepare.sh && bash ../shared/device/fetch-wheels.sh   # here, once
#   device run (carry .peer and .whl): bash tools/bench_gpu_vs_llamacpp.sh   (GEMV=0: without bench_gemv)
# A call carries at most 64 MiB of working tree, and the shipped models (58 MB) leave no room for .peer (15 MiB):
# before the call, `echo /o3edge/models/ >> .git/info/exclude; git rm -r -q --cached o3edge/models` (a
# random-weight benchmark does not need them), and `git reset -q` after it.
# DURING_BUILD="commands" runs more GPU-only measurements while llama.cpp builds (about 4.5 minutes);
# AFTER="commands" runs at the end (e.g. GPU tests with what is left of the call). More than 8 files in
# $OUT at the end are bundled into $OUT/results.tar.gz (the device brings back at most 8 files a call).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/o3bench}; mkdir -p "$OUT"
t0=$(date +%s)
VARIANTS=${VARIANTS:---int4 --int4-all}
# llama.cpp builds on the CPU cores while the GPU-only measurements run (they time graph replays and
# device events, which the build's CPU load does not touch); the end-to-end benchmarks wait for it
bash .peer/run.sh build > "$OUT/llamacpp-build.log" 2>&1 &
build=$!
if [ "${PROFILE:-1}" = 1 ]; then  # PROFILE=0: no step profiles (e.g. when DURING_BUILD needs the time)
  python3 tools/profile_gpu_step.py --shape llama-1b --dtype bfloat16 --variants "O3EDGE_GEMV_STREAM=0" --json "$OUT/profile-llama1b-bf16.json" 2>&1 | grep -v -i warn
  python3 tools/profile_gpu_step.py --shape tinyllama-1.1b --dtype float16 --variants "O3EDGE_GEMV_STREAM=0" --json "$OUT/profile-tinyllama-fp16.json" 2>&1 | grep -v -i warn
  python3 tools/profile_gpu_step.py --shape llama-1b --dtype bfloat16 --int4 --variants "O3EDGE_INT4_PACKED=0" --json "$OUT/profile-llama1b-int4.json" 2>&1 | grep -v -i warn
  python3 tools/profile_gpu_step.py --shape llama-1b --dtype bfloat16 --int4 --int4-all --variants "" --json "$OUT/profile-llama1b-int4-all.json" 2>&1 | grep -v -i warn
fi
[ "${GEMV:-1}" = 1 ] && python3 tools/bench_gemv.py --json "$OUT/gemv.json" 2>&1 | grep -v -i warn | grep -v "^best"
[ -n "${DURING_BUILD:-}" ] && bash -c "$DURING_BUILD"  # more GPU-only work (e.g. a kernel A/B)
echo "GPU-only part done at $(( $(date +%s) - t0 )) s"
wait "$build" || { tail -30 "$OUT/llamacpp-build.log"; exit 1; }
echo "llama.cpp built in $(( $(date +%s) - t0 )) s"
python3 tools/bench_gpu.py --model /tmp/lcw/ckpt --shape tinyllama-1.1b --dtype float16 $VARIANTS --skip-hf \
  --json "$OUT/o3edge-only.json" 2>&1 | grep -E "^o3edge"
bash .peer/run.sh bench > "$OUT/llamacpp-bench.log" 2>&1
python3 tools/bench_gpu.py --model /tmp/lcw/ckpt --shape tinyllama-1.1b --dtype float16 $VARIANTS --skip-hf \
  --reuse "$OUT/o3edge-only.json" --llamacpp "$OUT/llamacpp-bench.log" --json "$OUT/tinyllama-fp16.json"
echo "elapsed $(( $(date +%s) - t0 )) s"
[ -n "${AFTER:-}" ] && bash -c "$AFTER"
# the device brings back at most 8 files a call: more than that are bundled (tar xzf results.tar.gz)
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
  tar czf /tmp/o3bench-results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/o3bench-results.tar.gz "$OUT/results.tar.gz"
fi
