#!/usr/bin/env bash
# o3edge's CPU presets beside llama.cpp (Q4_0, Q8_0) on the same smol-135m checkpoint, interleaved in one run.
# Needs the CPU peers set up first: WORK=/tmp/peer-cpu bash ../shared/peers/cpu/setup.sh (~15 min on 2 cores).
# Every system runs in its own process (tools/bench_cpu_o3.py, the peers' bench_llamacpp.py) with the same
# definitions: batch 1, 2 threads, the peers' 128-token prompt, 128 greedy tokens, 1 warm-up + 3 timed runs,
# whole generations timed from outside the engine, peak RSS of the process. PASSES rounds, each system once
# per round, so slow phases of this shared machine hit every system alike.
# Usage: [PASSES=3] [THREADS=2] [FP32=1] [COMPILE=0] [NATIVE=1] bash tools/bench_cpu_peers.sh [OUT_DIR] [JSON]
#   NATIVE=1 (default): the cpu-int4-all and cpu-int4 engines also on [engine] backend = "native" (no torch in
#   the process: native_runner.py)
#   The cpu-int8 and cpu-int4 rows run the engine's default decode step (the native one, cpu_step.py, where it
#   applies). FP32=0: no float32 row; COMPILE=1: cpu-int8 and cpu-int4 rows with [engine] cpu_compile and the
#   native step off (their load includes compiling or loading the Inductor cache, which is not timed in the table)
set -euo pipefail
WORK=${WORK:-/tmp/peer-cpu}
PASSES=${PASSES:-3}
THREADS=${THREADS:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
PEERS=$(cd "$HERE/../../shared/peers/cpu" 2>/dev/null && pwd || echo /work/shared/peers/cpu)
OUT=${1:-/tmp/o3edge-cpu-peers}
JSON=${2:-$OUT/cpu-peers.json}
PROMPT=$WORK/models/prompt_smol-135m.json
CKPT=$WORK/models/smol-135m
PY=${PYTHON:-python3}
rm -rf "$OUT" && mkdir -p "$OUT"
for preset in cpu-int8 cpu-int4 cpu-int4-all; do  # engine dirs, built once from the peers' own checkpoint
  [ -f "$WORK/o3/smol-135m-$preset/manifest.json" ] || \
    PYTHONPATH="$HERE/.." $PY -m o3edge.build_cli build "$CKPT" "$WORK/o3/smol-135m-$preset" --preset "$preset" --force
done
llama() {  # name quant pass
  "$WORK/venv/bin/python" "$PEERS/bench_llamacpp.py" "$WORK/gguf/smol-135m-$2.gguf" "$PROMPT" --runs 3 --warmup 1 \
    --threads "$THREADS" --out "$OUT/pass$3/$1.json" > /dev/null
}
o3() {  # name model pass [extra bench_cpu_o3.py flags]
  PYTHONPATH="$HERE/.." $PY "$HERE/bench_cpu_o3.py" "$2" "$PROMPT" --runs 3 --warmup 1 --threads "$THREADS" \
    --label "$1" --profile 15 --out "$OUT/pass$3/$1.json" "${@:4}" > /dev/null 2>&1
}
for p in $(seq 1 "$PASSES"); do
  mkdir -p "$OUT/pass$p"
  echo "pass $p, load $(cut -d' ' -f1-3 /proc/loadavg)"
  llama "llama.cpp Q4_0" Q4_0 "$p"
  o3 "o3edge cpu-int8" "$WORK/o3/smol-135m-cpu-int8" "$p"
  llama "llama.cpp Q8_0" Q8_0 "$p"
  o3 "o3edge cpu-int4" "$WORK/o3/smol-135m-cpu-int4" "$p"
  o3 "o3edge cpu-int4-all" "$WORK/o3/smol-135m-cpu-int4-all" "$p"
  [ "${NATIVE:-1}" = 0 ] || o3 "o3edge cpu-int4-all native" "$WORK/o3/smol-135m-cpu-int4-all" "$p" --backend native
  [ "${NATIVE:-1}" = 0 ] || o3 "o3edge cpu-int4 native" "$WORK/o3/smol-135m-cpu-int4" "$p" --backend native
  [ "${COMPILE:-0}" = 0 ] || o3 "o3edge cpu-int8 compiled" "$WORK/o3/smol-135m-cpu-int8" "$p" --compile --no-native
  [ "${COMPILE:-0}" = 0 ] || o3 "o3edge cpu-int4 compiled" "$WORK/o3/smol-135m-cpu-int4" "$p" --compile --no-native
  [ "${FP32:-1}" = 0 ] || o3 "o3edge fp32" "$CKPT" "$p"
done
$PY "$HERE/bench_cpu_report.py" "$OUT" --json "$JSON" \
  --command "PASSES=$PASSES THREADS=$THREADS FP32=${FP32:-1} COMPILE=${COMPILE:-0} NATIVE=${NATIVE:-1} bash tools/bench_cpu_peers.sh" | tee "$OUT/table.md"
