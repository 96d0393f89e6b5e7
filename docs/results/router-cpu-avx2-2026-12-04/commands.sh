# 2026-12-04 fourteenth session, this CPU machine (2 cores, AVX-512 VNNI): the router's and span_attention's C++
# decode attention built for AVX2 (what an AVX2-only CPU builds), for AVX-512 (this machine's default), and off
# (torch's operations), the bfloat16 engine on the built-in long model, as in the thirteenth session's runs
D=docs/results/router-cpu-avx2-2026-12-04
for isa in avx2 off avx512 avx2 off avx512; do
  O3EDGE_CPU_ATTN_ISA=$isa python tools/bench_router.py --speed --dtype bfloat16 --prompts 2 --prompt-tokens 1500 \
    --new-tokens 129 --rounds 2 --only off,router-int8,router-int4 --json $D/$isa-$(date +%H%M%S).json 2>&1 \
    | grep -E "x of full|tok/s" | sed "s/^/$isa: /" | tee -a $D/speed.log
done
