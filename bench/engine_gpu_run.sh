#!/bin/bash
# The engine on one GPU, in device calls of under 10 minutes each (timeouts per part):
#   bash bench/engine_gpu_run.sh OUTDIR tests        # GPU tests of the engine and the paged-KV kernels
#   bash bench/engine_gpu_run.sh OUTDIR latency      # batch-1 decode (Llama-2-7B, Llama-3-8B, InternLM2-1.8B; W4, fp16)
#   bash bench/engine_gpu_run.sh OUTDIR throughput   # 512 × 512 in / 128 out, Llama-2-7B W4, KV 16 and 8
#   bash bench/engine_gpu_run.sh OUTDIR long         # KV capacity (KV 16/8/4) and long-context decode (KV 16/8)
#   bash bench/engine_gpu_run.sh OUTDIR chat TOKDIR  # chat characters/s, transformers generate vs the engine
# Parts may be combined: bash bench/engine_gpu_run.sh OUT "tests throughput long".
out=${1:?usage: bench/engine_gpu_run.sh OUTDIR PARTS [TOKENIZER_DIR]}
parts=${2:-"tests latency throughput long"}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
has() { [[ " $parts " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if has tests; then
  timeout 150 python -m pytest -q -m gpu tests/gpu/test_gpu_paged.py tests/gpu/test_gpu_engine.py 2>&1 | tail -25
fi
if has latency; then
  timeout 240 python -m bench.latency --out "$out"/latency.json 2>&1 | grep -v "it/s" | tail -12
fi
if has throughput; then
  timeout 200 python -m bench.throughput --out "$out"/throughput.json 2>&1 | grep -v "it/s" | tail -6
fi
if has long; then
  timeout 90 python -m bench.long_context --part capacity --out "$out"/capacity.json 2>&1 | grep -v "it/s" | tail -5
  timeout 200 python -m bench.long_context --part long --kv-bits 16,8 --out "$out"/long.json 2>&1 | grep -v "it/s" | tail -8
fi
if has chat; then
  tok=${3:?the chat part needs a tokenizer directory}
  timeout 60 python -m bench.lib.random_checkpoint llama2-7b /tmp/r7b --tokenizer "$tok" && \
  timeout 60 python -m quantkit.cli rtn /tmp/r7b --w-bits 4 --group-size 128 -o /tmp/r7b-w4 -q && \
  timeout 240 python -m bench.chat_speed /tmp/r7b-w4 --rounds 10 --max-new-tokens 128 --out "$out"/chat_speed.json 2>&1 \
    | grep -v "it/s" | tail -14
fi
