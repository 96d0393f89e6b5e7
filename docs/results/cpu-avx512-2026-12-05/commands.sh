# 2026-12-05 (sixteenth session, 00:05 UTC), this CPU machine (AMD EPYC, 2 cores, AVX-512 VNNI): today's code on its
# default build (AVX-512 VNNI) against llama.cpp built -DGGML_NATIVE=ON (../shared/peers/cpu/setup.sh, unchanged),
# the same day and machine as the AVX2 run (docs/results/cpu-avx2-2026-12-04/)
WORK=/tmp/peer-cpu bash ../shared/peers/cpu/setup.sh
D=docs/results/cpu-avx512-2026-12-05
WORK=/tmp/peer-cpu PASSES=2 FP32=0 bash tools/bench_cpu_peers.sh /tmp/o3-avx512-peers $D/cpu-peers-avx512.json
cp /tmp/o3-avx512-peers/table.md $D/cpu-peers-avx512.md
# a second run right after the first (00:33 UTC), the same command
WORK=/tmp/peer-cpu PASSES=2 FP32=0 bash tools/bench_cpu_peers.sh /tmp/o3-avx512-peers-2 $D/cpu-peers-avx512-2.json
cp /tmp/o3-avx512-peers-2/table.md $D/cpu-peers-avx512-2.md
