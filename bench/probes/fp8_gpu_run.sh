#!/bin/bash
# FP8 W8A8 against fp16 and W4 on one GPU (issue #35), in device calls of under 10 minutes each:
#   bash bench/probes/fp8_gpu_run.sh OUTDIR kernels   # the linears (bench.fp8_speed --tune: OUTDIR/fp8_table.json), GPU tests
#   bash bench/probes/fp8_gpu_run.sh OUTDIR engine    # prefill 2,048 + batch-1 decode, bench.throughput 512 × 512/128
#   bash bench/probes/fp8_gpu_run.sh OUTDIR serve     # quantkit serve fp16 / FP8, bench serve c16,c64; quantkit fp8 on 7B
# QUANTKIT_DISPATCH_TABLE=FILE runs the engine parts on the rows the kernels part wrote (else the built-in rows).
out=${1:?usage: bench/probes/fp8_gpu_run.sh OUTDIR kernels|engine|serve}
part=${2:?a part}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case $part in
kernels)
  timeout 260 python -m bench.fp8_speed --part kernels --tune --out "$out" 2>&1 | grep -v Warning
  timeout 300 python -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$out"/gpu_tests.log | tail -25
  ;;
engine)
  timeout 280 python -m bench.fp8_speed --part engine --out "$out" 2>&1 | grep -v "it/s"
  timeout 280 python -m bench.throughput --shapes llama2-7b --weights fp16,w4,fp8 --out "$out"/throughput.json 2>&1 \
    | grep -v "it/s" | tail -6
  ;;
serve)
  for w in fp16 fp8; do
    setsid python -m quantkit.cli serve random:llama2-7b:$w --port 24000 --quiet > "$out/server_$w.log" 2>&1 &
    pid=$!
    t0=$(date +%s)
    until curl -sf http://127.0.0.1:24000/health > /dev/null; do
      kill -0 $pid 2>/dev/null || { tail -5 "$out/server_$w.log"; break; }; sleep 1; done
    echo "$w: ready in $(( $(date +%s) - t0 )) s"
    for pass in 1 2; do
      timeout 150 python -m quantkit.cli bench serve http://127.0.0.1:24000 --concurrency 16,64 --input-len 512 \
        --output-len 128 -o "$out/serve_${w}_$pass" --quiet 2>&1 | grep "^| [0-9]" | sed "s/^/$w pass $pass /"
    done
    kill -TERM -$pid; for _ in $(seq 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  done
  python -c "from quantkit_testing.tiny import make_tokenizer; make_tokenizer().save_pretrained('/tmp/tok')" \
    2>/dev/null || PYTHONPATH=$PYTHONPATH:$PWD/tests/support python -c \
    "from quantkit_testing.tiny import make_tokenizer; make_tokenizer().save_pretrained('/tmp/tok')"
  timeout 150 python -m bench.lib.random_checkpoint llama2-7b /tmp/r7b --tokenizer /tmp/tok --device cuda
  t0=$(date +%s.%N)
  timeout 200 python -m quantkit.cli fp8 /tmp/r7b -o /tmp/r7b-fp8 2>&1 | grep -v "it/s" | tail -4
  echo "quantkit fp8 llama2-7b: $(python -c "print(round($(date +%s.%N) - $t0, 1))") s"
  echo "sizes (bytes): fp16 $(du -sb /tmp/r7b | cut -f1), fp8 $(du -sb /tmp/r7b-fp8 | cut -f1)"
  ;;
esac
