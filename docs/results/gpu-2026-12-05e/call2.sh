# call 2 (2026-12-05, twenty-second session): whole decode on the trained model, router INT8 against full precision
# in the same process, the route graph's scatter spread (router.py observe_books, this tree) against the code before
# (327bf40's router.py: `git show 327bf40:o3edge/engine/router.py > ab_old_router.py` before the call, carried into
# a copy of the tree), alternating, one round a process.
LIMIT=${CALL_LIMIT_S:-560}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
cp docs/results/gpu-2026-12-05e/call2.sh $R/commands.sh
rm -rf /tmp/old && mkdir /tmp/old && cp -r o3edge tools /tmp/old/ && cp ab_old_router.py /tmp/old/o3edge/engine/router.py
pack() { tar czf $OUT/call2.tgz -C $R .; }
run() {  # name, directory
  [ $SECONDS -gt $((LIMIT - 50)) ] && { echo "skip $1 at ${SECONDS}s"; return; }
  (cd $2 && PYTHONPATH=/tmp/site:$PWD timeout 80 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 \
    --rounds 1 --only off,router-int8 --json $R/router-$1.json > $R/router-$1.log 2>&1)
  python3 - $R/router-$1.json $1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))["results"]
off, rt = d["off (CUDA graphs)"], d["router-int8 (CUDA graphs)"]
print(sys.argv[2], "ratio", round(rt["decode_tokens_per_s"] / off["decode_tokens_per_s"], 3), "tok/s", off["decode_tokens_per_s"],
      rt["decode_tokens_per_s"], "steps", off["by_kind"]["other"]["median_ms"], {k: v["median_ms"] for k, v in rt["by_kind"].items()})
PY
  pack
}
for i in 1 2 3 4; do run new-$i $PWD; run old-$i /tmp/old; done
echo "done at ${SECONDS}s"
