# call 13 (twenty-fourth session, 2026-12-05; an H200 if one comes, a fresh machine): calls 9-12's whole decode on a
# third machine (call 8's host was slow at a refresh's demotions), three processes of three rounds, full precision
# beside the default router, the router at threshold 0.3 (INT8 and INT4) and uniform INT8.
NAME=call13 . tools/gpu_call.sh "$0"
for p in 1 2 3; do
  [ $SECONDS -gt $((LIMIT - 100)) ] && { echo "skip decode $p at ${SECONDS}s"; break; }
  timeout 120 python3 tools/bench_router.py --gpu --shape model --context 3840 --batch 16 --rounds 3 \
    --thresholds 0.3 --only off,uniform-int8,router-int8,router-int8-t0.3,router-int4-t0.3 \
    --json $R/router-$p.json > $R/router-$p.log 2>&1
  echo "decode $p at ${SECONDS}s"; tail -n 5 $R/router-$p.log | sed 's/; GPU step/\n    GPU step/'
  pack
done
echo "done at ${SECONDS}s"
