#!/usr/bin/env bash
# o3edged with a deliberately small batch (1 running, 1 queued) overflowing to llama.cpp's own
# llama-server. Three floods, each recorded by tools/overflow_check.py in $OUT/overflow-llama-server.jsonl:
#   up    -- llama-server running: every request served, some here, some upstream (zero lost);
#   down  -- llama-server killed: overflow is answered `busy`, the upstream breaker opens;
#   back  -- llama-server restarted: the breaker closes and overflow is served upstream again.
# Two ways to run it:
# - GPU machine, one call: builds llama.cpp and llama-server from the same source as
#   ../shared/peers/gpu/ (prepared into .peer/ by its prepare.sh); o3edge on the GPU reads the random
#   TinyLlama-1.1B-shaped HF checkpoint, llama-server its F16 GGUF.
#     bash ../shared/peers/gpu/prepare.sh && bash ../shared/device/fetch-wheels.sh   # here, once
#     device run (carry .peer and .whl): bash tools/overflow_llama_server.sh
# - Any machine with a llama-server binary and a GGUF: o3edge on the CPU with its built-in model.
#     LLAMA_SERVER=/path/llama-server GGUF=/path/model.gguf bash tools/overflow_llama_server.sh
set -uo pipefail
OUT=${OUT:-/tmp/o3overflow}; mkdir -p "$OUT"; W=/tmp/lcw; PORT_UP=${PORT_UP:-8081}; PORT_HTTP=${PORT_HTTP:-8080}
t0=$(date +%s)
if [ -z "${LLAMA_SERVER:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
  bash .peer/run.sh build > "$OUT/llamacpp-build.log" 2>&1 || { tail -30 "$OUT/llamacpp-build.log"; exit 1; }
  cmake -S $W/llama.cpp -B $W/build -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON > "$OUT/server-cmake.log" 2>&1 \
    && cmake --build $W/build -j 16 --target llama-server > "$OUT/server-build.log" 2>&1 \
    || { tail -30 "$OUT/server-build.log" "$OUT/server-cmake.log"; exit 1; }
  echo "llama.cpp and llama-server built in $(( $(date +%s) - t0 )) s"
  LLAMA_SERVER=$W/build/bin/llama-server; GGUF=$W/tl-F16.gguf; SERVER_ARGS="-ngl 99 -np 16 -c 16384"
  ENGINE="model_path = \"$W/ckpt\"
device = \"cuda\""
else
  SERVER_ARGS="-np 4 -c 4096 -t 1"
  ENGINE="device = \"cpu\""  # the built-in model
fi
export PYTHONUNBUFFERED=1

start_upstream() {
  $LLAMA_SERVER -m $GGUF --host 127.0.0.1 --port $PORT_UP $SERVER_ARGS >> "$OUT/llama-server.log" 2>&1 &
  UP_PID=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:$PORT_UP/health > /dev/null && return 0; sleep 1; done
  echo "llama-server did not become ready"; tail -20 "$OUT/llama-server.log"; exit 1
}

cat > "$OUT/o3edge.toml" <<TOML
[engine]
$ENGINE
max_num_seqs = 1
[server]
endpoint = "ipc://$OUT/o3.sock"
queue_max_requests = 1
[http]
enabled = true
listen = "127.0.0.1:$PORT_HTTP"
[upstream]
url = "http://127.0.0.1:$PORT_UP/v1"
model = "$(basename "$GGUF" .gguf)"
breaker_threshold = 1
breaker_cooldown_s = 2.0
TOML
start_upstream
XDG_STATE_HOME=$OUT python3 -m o3edge.daemon --config "$OUT/o3edge.toml" > "$OUT/o3edged.log" 2>&1 &
O3_PID=$!
python3 -m o3edge.cli health --endpoint "ipc://$OUT/o3.sock" --wait 300 || { tail -30 "$OUT/o3edged.log"; exit 1; }
CHECK="python3 tools/overflow_check.py --endpoint ipc://$OUT/o3.sock --http http://127.0.0.1:$PORT_HTTP/v1 \
  --requests 32 --max-tokens 64 --json $OUT/overflow-llama-server.jsonl"
$CHECK --phase up
kill $UP_PID; wait $UP_PID 2>/dev/null
$CHECK --phase down
start_upstream; sleep 3  # past the breaker's cooldown: the next overflow probes the upstream
$CHECK --phase back
kill $UP_PID $O3_PID; wait 2>/dev/null
grep -E "upstream|breaker" "$OUT/o3edged.log" | tail -20
echo "elapsed $(( $(date +%s) - t0 )) s; records in $OUT/overflow-llama-server.jsonl"
