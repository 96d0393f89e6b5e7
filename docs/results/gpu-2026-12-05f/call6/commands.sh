# call 6 (2026-12-05, twenty-third session): with fine tiles the router's attention alone is below full
# precision's (call 5: 12.81 against 13.13 us a layer) but its GPU step is not (0.324 against 0.302 ms): each
# kernel's own time a decode step, programmatic dependent launch off so that no kernel's time is its wait for
# the one before (as gpu-2026-12-05b/call3 did), router INT8 first, then full precision. One archive.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
cp docs/results/gpu-2026-12-05f/call6.sh $R/commands.sh
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/machine.txt
pack() { tar czf $OUT/call6.tgz -C $R .; }
for s in router-int8 off; do
  O3EDGE_PDL=0 timeout 60 python3 tools/profile_router_step.py --trace --shape model --context 3840 --batch 16 \
    --steps 48 --setting $s --json $R/trace-nopdl-$s.json > $R/trace-nopdl-$s.log 2>&1
  echo "$s done at ${SECONDS}s"; pack
done
