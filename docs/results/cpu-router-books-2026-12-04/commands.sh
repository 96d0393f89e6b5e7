# 2026-12-04 sixteenth session, this CPU machine (2 cores): a refresh's demotion books (170 demotions, 16 x 3,840
# tokens, the built-in long model's KV shape), HEAD 7655e0b (a worktree at /tmp/head) against the new
# RouterBlocks.demote_all, alternating; "books" in each JSON's median_ms (the flush here is torch's, on the CPU)
R=docs/results/cpu-router-books-2026-12-04
for i in 1 2 3; do
  (cd /tmp/head && PYTHONPATH=/tmp/head python tools/bench_demotions.py --repeat 100 --json /work/main/$R/books-7655e0b-$i.json)
  PYTHONPATH=. python tools/bench_demotions.py --repeat 100 --json $R/books-new-$i.json
done
# review mend (the free list's books through RouterBlocks._comp_unfree and _forget_name again, not inlined copies)
for i in 1 2 3; do python tools/bench_demotions.py --repeat 100 --json $R/books-helpers-$i.json; done
