#!/bin/bash
# `quantkit serve` on one GPU (random:llama2-7b:w4), in device calls of under 10 minutes each:
#   bash bench/probes/serve_gpu_run.sh overhead OUTDIR OLD_TREE   # bench serve c1,64 ×3: OLD_TREE's server, then this one's
#   bash bench/probes/serve_gpu_run.sh soak-start DIR [MINUTES]   # serve + bench.soak (c64, kills at 2 and 6 min), detached
#   bash bench/probes/serve_gpu_run.sh soak-wait DIR SECONDS      # wait for the detached soak (at most SECONDS), show it
# The soak runs in a session of its own (setsid) so that it outlasts the call that started it; the next
# call, made while the machine is still warm, waits for it.
set -u
part=${1:?usage: bench/probes/serve_gpu_run.sh overhead|soak-start|soak-wait DIR ...}
dir=${2:?a directory}
mkdir -p "$dir"
export PYTHONUNBUFFERED=1
model=random:llama2-7b:w4

case $part in
overhead)
  # Each tree's own server; `quantkit bench serve --concurrency 1,64` three times against it (pass 1 meets
  # the first-seen Triton shapes: a warm-up), bench_serve.json of passes 2 and 3 kept.
  old=${3:?the old tree}
  for tree in "$old" "$PWD"; do
    label=$([ "$tree" = "$PWD" ] && echo new || echo old)
    (cd "$tree" || exit 1
     export PYTHONPATH=.:${PYTHONPATH:-}
     setsid python -m quantkit.cli serve "$model" --port 24000 --quiet > "$dir/server_$label.log" 2>&1 &
     pid=$!
     until curl -sf http://127.0.0.1:24000/health > /dev/null; do kill -0 $pid 2>/dev/null || exit 1; sleep 1; done
     for pass in 1 2 3; do
       python -m quantkit.cli bench serve http://127.0.0.1:24000 --concurrency 1,64 --input-len 512 \
         --output-len 128 -o "$dir/${label}_$pass" --quiet 2>&1 | grep "^| [0-9]" | sed "s/^/$label pass $pass /"
     done
     kill -TERM -$pid; for _ in $(seq 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done)
  done
  ;;
soak-start)
  minutes=${3:-10}
  {
    echo "export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1"
    echo "cd $PWD"
    echo "start=\$(date +%s)"
    echo "python -m quantkit.cli serve $model --port 23333 --quiet > $dir/server.log 2>&1 &"
    echo "pid=\$!"
    echo "until curl -sf http://127.0.0.1:23333/health > /dev/null; do"
    echo "  kill -0 \$pid 2>/dev/null || { echo 'the server exited' > $dir/soak.log; echo failed > $dir/done; exit 1; }"
    echo "  sleep 1"
    echo "done"
    echo "echo \"server pid \$pid up after \$(( \$(date +%s) - start )) s\" > $dir/soak.log"
    echo "nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader >> $dir/soak.log"
    echo "python -m bench.soak --url http://127.0.0.1:23333 --minutes $minutes --concurrency 64 --server-pid \$pid \\"
    echo "  --kill-engine-at 120,360 --output $dir/soak.json >> $dir/soak.log 2>&1"
    echo "echo \"soak exit \$?\" >> $dir/soak.log"
    echo "kill -TERM \$pid; wait \$pid 2>/dev/null"
    echo "echo done > $dir/done"
  } > "$dir/run.sh"
  setsid bash "$dir/run.sh" > "$dir/run.out" 2>&1 < /dev/null &
  echo "soak started in the background ($dir)"
  ;;
soak-wait)
  limit=${3:?seconds}
  for _ in $(seq "$limit"); do
    [ -e "$dir/done" ] && break
    sleep 1
  done
  [ -e "$dir/done" ] && echo "soak finished" || echo "soak still running"
  tail -40 "$dir/soak.log" 2>/dev/null; tail -5 "$dir/run.out"
  ;;
esac
