# call 3 (2026-12-05, twenty-second session): tokens per joule at batch 1 and 32 (issue 12) on an H200, o3edge with
# every linear INT4 beside llama.cpp Q4_0 in the same call. o3edge runs first, before llama.cpp's build loads the
# host's cores; then llama.cpp is built (../shared/peers/gpu/run.sh build, carried as .peer/) and its energy is
# measured as run.sh's `energy` phase measures it (one configuration a process, long decodes, the load's joules
# taken off), for Q4_0 at 1 and 32 streams only (the call's 600 s hold no more). Every part is packed as it ends.
LIMIT=${CALL_LIMIT_S:-580}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
cp docs/results/gpu-2026-12-05e/call3.sh $R/commands.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/machine.txt
cat $R/machine.txt
pack() { tar czf $OUT/call3.tgz -C $R .; }
timeout 150 python3 tools/bench_gpu.py --shape tinyllama-1.1b --dtype float16 --int4-all --skip-base --batches 1,32 \
  --skip-hf --json $R/o3edge.json > $R/o3edge.log 2>&1
grep -E "^o3edge" $R/o3edge.log; echo "o3edge done at ${SECONDS}s"; pack
OUT=$R bash .peer/run.sh build > $R/llamacpp-build.log 2>&1 || { tail -20 $R/llamacpp-build.log; pack; exit 1; }
grep -E "build_s|phase1_s" $R/llamacpp-build.log; echo "built at ${SECONDS}s"; pack
cd /tmp/lcw && sed -n '/^energy)/,/^PY$/p' $OLDPWD/.peer/run.sh | sed '1,2d;$d' > nvml_wrap.py
{
  for spec in "1 2048" "32 1024"; do set -- $spec
    [ $SECONDS -gt $((LIMIT - 40)) ] && { echo "skip npl=$1 at ${SECONDS}s"; continue; }
    echo "== energy Q4_0 npl=$1 ntg=$2"
    python3 nvml_wrap.py build/bin/llama-batched-bench -m tl-Q4_0.gguf -c $(( $1 * ($2 + 128) + 256 )) -b 2048 -ub 512 \
      -npp 128 -ntg $2 -npl $1 -ngl 99 -fa on 2>&1 | grep -E "^\|  |ENERGY"
  done
  echo "== energy: load only (ntg 1)"
  python3 nvml_wrap.py build/bin/llama-batched-bench -m tl-Q4_0.gguf -c 1024 -b 2048 -ub 512 -npp 128 -ntg 1 -npl 1 \
    -ngl 99 -fa on 2>&1 | grep -E "ENERGY"
} > $R/llamacpp-energy.log 2>&1
cd $OLDPWD
cat $R/llamacpp-energy.log
python3 tools/bench_gpu.py --shape tinyllama-1.1b --dtype float16 --int4-all --skip-base --batches 1,32 --skip-hf \
  --reuse $R/o3edge.json --llamacpp $R/llamacpp-energy.log,$R/llamacpp-energy.log --json $R/tinyllama-tokj.json 2>&1 | tail -12
pack
echo "done at ${SECONDS}s"
