# 2026-12-04 fifteenth session, this CPU machine (AMD EPYC, 2 cores, AVX-512 VNNI and AVX-VNNI)
D=docs/results/cpu-avxvnni-2026-12-04
for isa in avx512 avxvnni; do
  O3EDGE_CPU_ISA=$isa python tools/bench_cpu_kernels.py --rows 1 8 128 --json $D/kernels-$isa.json > $D/kernels-$isa.md
done
python tools/make_tiny_model.py /tmp/avxv/ckpt --shape smol-135m
python -m o3edge.build_cli build /tmp/avxv/ckpt /tmp/avxv/eng --preset cpu-int4 --force
python -c "import json,random; random.seed(0); json.dump([random.randrange(100,40000) for _ in range(128)], open('/tmp/avxv/prompt.json','w'))"
for r in 1 2; do for isa in avx512 avxvnni; do
  O3EDGE_CPU_ISA=$isa python tools/bench_cpu_o3.py /tmp/avxv/eng /tmp/avxv/prompt.json --runs 3 --warmup 1 --backend native \
    --label "cpu-int4 native $isa" --out $D/decode-$isa-$r.json
done; done
O3EDGE_CPU_KERNELS=torch python tools/bench_cpu_o3.py /tmp/avxv/eng /tmp/avxv/prompt.json --runs 3 --warmup 1 \
  --label "cpu-int4 torch kernels" --out $D/decode-torch-kernels.json
# after one vpdpbusd chain a row for several rows on AVX-VNNI (cpu_kernels.h kOneChainRows), same machine, 22:03-22:06 UTC
O3EDGE_CPU_ISA=avxvnni python tools/bench_cpu_kernels.py --rows 1 8 128 --json $D/kernels-avxvnni-one-chain.json \
  > $D/kernels-avxvnni-one-chain.md
for r in 1 2; do
  O3EDGE_CPU_ISA=avxvnni python tools/bench_cpu_o3.py /tmp/avxv/eng /tmp/avxv/prompt.json --runs 3 --warmup 1 --backend native \
    --label "cpu-int4 native avxvnni, one chain" --out $D/decode-avxvnni-one-chain-$r.json
  O3EDGE_CPU_ISA=avx512 python tools/bench_cpu_o3.py /tmp/avxv/eng /tmp/avxv/prompt.json --runs 3 --warmup 1 --backend native \
    --label "cpu-int4 native avx512 (same run)" --out $D/decode-avx512-same-run-$r.json
done
