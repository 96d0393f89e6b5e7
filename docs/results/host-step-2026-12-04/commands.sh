# 2026-12-04 fourteenth session, this CPU machine (2 cores): the engine's host step with the model stubbed out, full
# precision's graph path, 16 and 32 sequences of 3,072 tokens; Scheduler._continue linear ("after") against its
# quadratic form at HEAD 1b2f732 ("before", the change stashed), alternating
for v in after before after before; do
  [ $v = before ] && git stash -q
  for b in 16 32; do
    python tools/bench_host_step.py --setting off --batch $b --repeat 3 --steps 256 --json $v-b$b-$(date +%H%M%S).json
  done
  [ $v = before ] && git stash pop -q
done
# py-spy record -r 3000 -f raw -o spy.txt -- python tools/bench_host_step.py --setting off --batch 32 --repeat 3 --steps 256; grep 'bench_host_step.py:89)' spy.txt | gzip > spy-b32-after.txt.gz  (the decode loop's stacks only)
