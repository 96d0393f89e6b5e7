# 2026-12-04 sixteenth session, this CPU machine (AMD EPYC, 2 cores) run as an AVX2-only CPU: o3edge's row kernels
# and native step built for AVX2 (O3EDGE_CPU_ISA=avx2: no VNNI, no AVX-512), its attention for AVX2, torch's
# kernels at ATen's AVX2 level and fbgemm's AVX2 path; llama.cpp (llama-cpp-python 0.3.36, the peers' version)
# built for AVX2 only (-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON, AVX-512 and
# VNNI off: its system_info in each llama.cpp JSON), set up as ../shared/peers/cpu/setup.sh does, in /tmp/peer-avx2.
# MKL, oneDNN and NumPy are held to AVX2 as well. The memory system and clocks are this machine's: only the
# instruction sets are an AVX2 CPU's.
set -e
D=docs/results/cpu-avx2-2026-12-04
export O3EDGE_CPU_ISA=avx2 O3EDGE_CPU_ATTN_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \
  MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR"
WORK=/tmp/peer-avx2 PASSES=2 FP32=0 bash tools/bench_cpu_peers.sh /tmp/o3-avx2-peers $D/cpu-peers-avx2.json
cp /tmp/o3-avx2-peers/table.md $D/cpu-peers-avx2.md
# what an AVX2 CPU ran before this build: torch's kernels (fbgemm's AVX2 path for INT8, ATen's for INT4)
for r in 1 2; do for p in cpu-int8 cpu-int4; do
  O3EDGE_CPU_KERNELS=torch python tools/bench_cpu_o3.py /tmp/peer-avx2/o3/smol-135m-$p /tmp/peer-avx2/models/prompt_smol-135m.json \
    --runs 3 --warmup 1 --threads 2 --label "o3edge $p, torch kernels (AVX2)" --out $D/torch-kernels-$p-$r.json > /dev/null 2>&1
done; done
python tools/bench_cpu_kernels.py --rows 1 8 128 --json $D/kernels-avx2.json > $D/kernels-avx2.md 2>/dev/null
# 00:50 UTC, after the AVX2 build's INT8 activations were stored as int8 itself (no xor a product: kDotBiased), the
# same settings exported as above
python tools/bench_cpu_kernels.py --rows 1 8 128 --json $D/kernels-avx2-no-xor.json
