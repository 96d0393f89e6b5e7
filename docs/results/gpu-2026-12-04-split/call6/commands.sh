#!/bin/bash
# GPU call 6: decode attention's tiling at batch 1 (tinyllama, fp16): alone at two contexts, then in the step's graph
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,clocks.current.sm,power.draw --format=csv > $OUT/machine.txt
t0=$(date +%s)
C='[[32,2,2],[64,2,2],[64,8,2],[32,4,2],[64,4,1],[64,4,3],[128,4,2],[128,8,2]]'
for ctx in 256 2048; do
timeout 100 python3 tools/bench_attention.py --shape tinyllama-1.1b --batch 1 --context $ctx --dtype float16 --cases off --splits 8,16 --configs "$C" --json $OUT/attn-b1-$ctx.json > $OUT/attn-$ctx.log 2>&1
echo "attn $ctx $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
done
V="O3EDGE_ATTN_TILING=64,2,2;O3EDGE_ATTN_TILING=32,4,2;O3EDGE_ATTN_TILING=64,8,2;O3EDGE_ATTN_TILING=64,4,1;O3EDGE_ATTN_TILING=128,4,2;O3EDGE_ATTN_TILING=64,4,2"
timeout 120 python3 tools/profile_gpu_step.py --shape tinyllama-1.1b --dtype float16 --variants "$V" --json $OUT/prof-tiny-fp16.json > $OUT/prof.log 2>&1
echo "end $(( $(date +%s) - t0 )) s" >> $OUT/machine.txt
grep -h "planned\|best" $OUT/attn-*.log
python3 -c "import json;d=json.load(open('$OUT/prof-tiny-fp16.json'));print(d['graph_replay_ms'], d['variants'])"
