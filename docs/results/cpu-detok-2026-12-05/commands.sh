# 2026-12-05 twentieth session, CPU machine: the detokenizer's host cost a token over 16,000 tokens, by slices of
# 4,000, before (125b3ec, all text kept) and after (8c1982b, only what is not yet shown), alternating
git worktree add /tmp/wt-detok 125b3ec && cp tools/bench_detok.py /tmp/wt-detok/tools/
for i in 1 2; do
  python /tmp/wt-detok/tools/bench_detok.py --repeat 2 --json before-$i.json
  python tools/bench_detok.py --repeat 2 --json after-$i.json
done
for i in 1 2; do
  python /tmp/wt-detok/tools/bench_detok.py --repeat 2 --stop "never in the text" --json before-stop-$i.json
  python tools/bench_detok.py --repeat 2 --stop "never in the text" --json after-stop-$i.json
done
