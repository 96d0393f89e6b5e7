#!/usr/bin/env bash
# o3edge beside llama.cpp (Q4_0, F16) and transformers on the same smol-135m checkpoint, one run.
# Needs the CPU peers set up first: bash ../shared/peers/cpu/setup.sh (WORK=/tmp/peer-cpu, ~20 min).
# Usage: bash tools/bench_cpu_peers.sh [OUT_DIR]
set -euo pipefail
WORK=${WORK:-/tmp/peer-cpu}
PEERS=$(cd "$(dirname "$0")/../../shared/peers/cpu" 2>/dev/null && pwd || echo /work/shared/peers/cpu)
OUT=${1:-/tmp/o3edge-cpu-peers}
mkdir -p "$OUT"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for q in Q4_0 F16; do
  "$WORK/venv/bin/python" "$PEERS/bench_llamacpp.py" "$WORK/gguf/smol-135m-$q.gguf" "$WORK/models/prompt_smol-135m.json" \
    --runs 3 --warmup 1 --threads 2 --out "$OUT/llamacpp_$q.json" > "$OUT/llamacpp_$q.log" 2>&1
  python3 - "$OUT/llamacpp_$q.json" "$q" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
med = {k: v for k, v in r.items() if not isinstance(v, (list, dict))}
print(f"llama.cpp {sys.argv[2]}:", {k: med[k] for k in sorted(med) if any(s in k for s in ("ttft", "decode", "rss"))})
PY
done
python3 "$(dirname "$0")/bench_engine.py" decode "$WORK/models/smol-135m" --tokens 64 --reps 3 --batches 1 \
  --variants hf-fp32 o3-fp32 o3-int4 --threads 2 | tee "$OUT/o3edge.md"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
