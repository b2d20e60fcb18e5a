#!/bin/bash
# The engine on one GPU, in one device call of under 10 minutes (timeouts per part):
#   bash bench/engine_gpu_run.sh OUTDIR           # GPU tests of the engine, latency table, throughput table
#   bash bench/engine_gpu_run.sh OUTDIR latency   # only the latency table (Llama-2-7B, Llama-3-8B, InternLM2-1.8B; W4, fp16)
#   bash bench/engine_gpu_run.sh OUTDIR throughput
out=${1:?usage: bench/engine_gpu_run.sh OUTDIR [tests|latency|throughput]}
part=${2:-all}
mkdir -p "$out"
export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$part" = all ] || [ "$part" = tests ]; then
  timeout 150 python -m pytest -q -m gpu tests/gpu/test_gpu_engine.py -x 2>&1 | tail -25
fi
if [ "$part" = all ] || [ "$part" = latency ]; then
  timeout 240 python -m bench.latency --out "$out"/latency.json 2>&1 | grep -v "it/s" | tail -12
fi
if [ "$part" = all ] || [ "$part" = throughput ]; then
  timeout 200 python -m bench.throughput --out "$out"/throughput.json 2>&1 | grep -v "it/s" | tail -6
fi
