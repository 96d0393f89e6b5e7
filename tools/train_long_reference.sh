#!/usr/bin/env bash
# Train the long-context reference model in one GPU call and bring it back through $OUT.
#
#   python tools/reference_corpus.py pack .corpus/reference-corpus-long.jsonl.xz --sources docs,stdlib,src  # once, on CPU
#   bash tools/train_long_reference.sh          # on the GPU machine (carry .corpus: git ignores it);
#                                               # MINUTES=5 by default, the shipped model used MINUTES=6.4
#
# $OUT gets: train-long.log, long-metrics.json (pass-key accuracy by length/depth, chat accuracy on
# held-out names, held-out perplexity, the loss curve) and the bf16 checkpoint as
# o3edge-ref-long.tar.xz.part-aa, -ab, ... (parts of 15 MB: files come back at most 16 MiB each).
# Put it back together with: cat o3edge-ref-long.tar.xz.part-* | xz -d | tar x
set -euo pipefail
OUT=${OUT:-out}
PACK=.corpus/reference-corpus-long.jsonl.xz
CKPT=${CKPT:-/tmp/o3edge-ref-long}
mkdir -p "$OUT"
[ -f "$PACK" ] || { echo "missing $PACK: pack it on a machine with python3.11-doc first" >&2; exit 2; }
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
status=0
# DEVICE=cpu EXTRA="--tiny --steps 4 --max-docs 120" runs the same script as a CPU smoke test
python tools/train_reference.py --shape long --device "${DEVICE:-cuda}" --data "$PACK" --sources docs,stdlib,src \
    --out "$CKPT" --metrics "$OUT/long-metrics.json" --max-minutes "${MINUTES:-5}" --seed 0 ${EXTRA:-} \
    2>&1 | tee "$OUT/train-long.log" || status=$?
# the best checkpoint is on disk from the first validation on: bring it back even if the end failed
if [ -f "$CKPT/model.safetensors" ]; then
    tar cf - -C "$(dirname "$CKPT")" "$(basename "$CKPT")" | xz -T0 -3 | split -b 15M - "$OUT/o3edge-ref-long.tar.xz.part-"
fi
ls -l "$OUT"
exit "$status"
