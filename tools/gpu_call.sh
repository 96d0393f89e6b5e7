# Sourced by a GPU machine call's script (docs/results/gpu-*/callN.sh): the wheels carried as .whl/ installed
# where Python finds them, the results folder $R with the script itself and the machine's name in it, and pack,
# which archives $R into $OUT/NAME.tgz (a call brings back at most 8 files; pack after each part, so what is
# done comes back if the call is cut). Usage, at the top of a call script:
#   NAME=call7 . tools/gpu_call.sh "$0"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
LIMIT=${CALL_LIMIT_S:-560}  # the call's time limit, from which each part's last start is reckoned
R=/tmp/r
rm -rf $R && mkdir -p $R  # a warm machine keeps /tmp between calls
cp "$1" $R/commands.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $R/machine.txt
lscpu | grep -E "^(Model name|CPU\(s\)|CPU max MHz)" >> $R/machine.txt  # the host: a small model's step is mostly its time
cat $R/machine.txt
CALL_NAME=${NAME:-call}  # kept: an assignment before "." lasts only while this file is read
pack() { tar czf "$OUT/$CALL_NAME.tgz" -C $R .; }
