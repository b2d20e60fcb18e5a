#!/bin/bash
# Issue #38 on one GPU, in device calls of under 10 minutes each:
#   bash bench/probes/async_gpu_run.sh engine OUT   # bench.engine_async (sync vs async, b1/c64, passes), ncu of the
#                                                   # KV8/KV4 decode kernels at b32 x 4k, their tile sweep, FP8 GPU tests
#   bash bench/probes/async_gpu_run.sh serve OUT    # KV4 vs KV8 decode at b32 x 4k; quantkit serve 7B W4: ready time with
#                                                   # cold/warm caches (KV16, KV8), bench serve c1,16,64 first and second
#                                                   # pass (needs .whl carried)
#   bash bench/probes/async_gpu_run.sh all OUT      # what of both fits one call (7B W4/fp16 and 1.8B; no KV4 engine run)
set -u
part=${1:?usage: bench/probes/async_gpu_run.sh engine|serve|all OUT}
out=${2:?an output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
began=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - began) )); }

case $part in
engine)
  export PYTHONPATH=$PWD
  timeout "$(left 400)" python3 -m bench.engine_async --passes --shapes llama2-7b,internlm2-1.8b,llama3-8b \
    --out "$out/engine_async.json" 2>&1 | grep -v "^Loading\|it/s" | tee "$out/engine_async.log" | cut -c1-3000
  echo "engine_async done at $(( $(date +%s) - began )) s"
  timeout "$(left 520)" python3 bench/probes/kv4_occupancy.py --out "$out/kv4_occupancy.json" 2>&1 | tail -45
  echo "kv4 probe done at $(( $(date +%s) - began )) s"
  ;;
all)
  # One call when the device budget allows one only (about 7 minutes): engine (7B W4 and fp16), then serve
  # (KV16 cold and warm, first and second pass, KV8 cold if time is left), then the KV4 probe with what is left.
  PYTHONPATH=$PWD timeout "$(left 200)" python3 -m bench.engine_async --passes --shapes llama2-7b \
    --out "$out/engine_async.json" 2>&1 | grep -v "^Loading\|it/s" | tee "$out/engine_async.log" | cut -c1-2500
  echo "engine_async done at $(( $(date +%s) - began )) s"
  quick=1 ;&
serve)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  model=random:llama2-7b:w4
  start_server() {  # label kv_bits cache_dir: time from launch to /health answering 200
    local t0; t0=$(date +%s.%N)
    setsid python3 -m quantkit.cli serve $model --port 24000 --kv-bits "$2" --cache-dir "$3" > "$out/server_$1.log" 2>&1 &
    pid=$!
    until curl -sf http://127.0.0.1:24000/health > /dev/null; do
      kill -0 $pid 2>/dev/null || { echo "$1: the server exited"; tail -20 "$out/server_$1.log"; return 1; }
      sleep 0.25
    done
    echo "$1 ready after $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"
  }
  stop_server() { kill -TERM -$pid 2>/dev/null; for _ in $(seq 120); do kill -0 $pid 2>/dev/null || return; sleep 0.25; done; kill -9 -$pid; }
  if [ -z "${quick:-}" ]; then
    timeout 200 python3 -m bench.long_context --part long --cases b32-4k --kv-bits 8,4 --out "$out/kv4_kv8.json" 2>&1 | tail -8
    echo "long_context done at $(( $(date +%s) - began )) s"
  fi
  start_server kv16_cold 16 /tmp/cache_a || exit 1
  for pass in 1 2; do
    python3 -m quantkit.cli bench serve http://127.0.0.1:24000 --concurrency 1,16,64 --input-len 512 --output-len 128 \
      -o "$out/pass$pass" --quiet 2>&1 | grep "^| [0-9]" | sed "s/^/pass $pass /"
  done
  stop_server
  start_server kv16_warm 16 /tmp/cache_a; stop_server
  limit=$([ -n "${quick:-}" ] && echo 400 || echo 590)
  [ "$(left $limit)" -gt 120 ] && { start_server kv8_cold 8 /tmp/cache_b; stop_server; }
  [ "$(left $limit)" -gt 40 ] && [ -z "${quick:-}" ] && { start_server kv8_warm 8 /tmp/cache_b; stop_server; }
  grep -h "start:" "$out"/server_*.log | head -60
  if [ -n "${quick:-}" ] && [ "$(left 440)" -gt 30 ]; then
    PYTHONPATH=$PWD timeout "$(left 440)" python3 bench/probes/kv4_occupancy.py --out "$out/kv4_occupancy.json" 2>&1 \
      | grep "best\|regs - \|regs  128 n128\|regs   96 n128" | head -30
  fi
  ;;
esac
echo "total $(( $(date +%s) - began )) s"
