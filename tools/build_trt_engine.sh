#!/usr/bin/env bash
# Build a TensorRT engine from an `o3edge export` directory, on a machine where TensorRT is installed
# (a Jetson with JetPack, or a desktop GPU with TensorRT), and write its precision-alignment table
# against the torch engine.
#
#   tools/build_trt_engine.sh ONNX_DIR [MAX_BATCH=8] [MAX_LEN=2048]
#
# 1. trtexec builds ONNX_DIR/model.plan in FP16 with dynamic shapes (batch 1..MAX_BATCH, sequence
#    1..MAX_LEN, past 0..MAX_LEN-1). Exports with INT4 FFN weights use ONNX Runtime's MatMulNBits,
#    which TensorRT's ONNX parser does not read: build those for ONNX Runtime, or export dense.
# 2. If this ONNX Runtime has the TensorRT execution provider (onnxruntime-gpu built with TensorRT),
#    the alignment table is computed through it and stored in ONNX_DIR/onnx.json.
# Neither step has been run on o3edge's own machines: TensorRT cannot be installed there.
set -euo pipefail
dir=${1:?usage: $0 ONNX_DIR [MAX_BATCH] [MAX_LEN]}; max_b=${2:-8}; max_len=${3:-2048}
trtexec=$(command -v trtexec || ls /usr/src/tensorrt/bin/trtexec 2>/dev/null || true)
[ -n "$trtexec" ] || { echo "trtexec not found: install TensorRT (JetPack ships /usr/src/tensorrt/bin/trtexec)" >&2; exit 2; }
shapes=$(python3 - "$dir" "$max_b" "$max_len" <<'PY'
import json, sys
d, B, L = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = json.load(open(f"{d}/onnx.json"))
if m.get("int4_group_size"):
    sys.exit("this export has INT4 MatMulNBits weights, which TensorRT's parser does not read; export dense")
kv = lambda b, p: f"{b}x{m['num_kv_heads']}x{p}x{m['head_dim']}"
def spec(b, t, p):
    s = [f"input_ids:{b}x{t}", f"position_ids:{b}x{t}", f"attention_mask:{b}x{p + t}"]
    return ",".join(s + [f"{n}:{kv(b, p)}" for n in m["inputs"][3:]])
print(f"--minShapes={spec(1, 1, 0)} --optShapes={spec(1, 1, L // 2)} --maxShapes={spec(B, L // 2, L // 2)}")
PY
)
# shellcheck disable=SC2086
"$trtexec" --onnx="$dir/model.onnx" --saveEngine="$dir/model.plan" --fp16 $shapes
src=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['source'])" "$dir/onnx.json")
python3 - "$src" "$dir" <<'PY'
import sys
import onnxruntime as ort
from o3edge.engine.precision import PrecisionReport
from o3edge.export.onnx_export import check_onnx
if "TensorrtExecutionProvider" not in ort.get_available_providers():
    sys.exit("model.plan built; this ONNX Runtime has no TensorRT provider, so no alignment table was made")
print(check_onnx(sys.argv[1], sys.argv[2], providers=["TensorrtExecutionProvider"]).format())
PY
