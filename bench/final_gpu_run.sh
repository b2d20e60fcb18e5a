#!/bin/bash
# The published kernel figures in one device call (BENCHMARKS.md, "Kernels"): table, checks, end to end, decode.
#   bash bench/final_gpu_run.sh OUTDIR
out=${1:?usage: bench/final_gpu_run.sh OUTDIR}
mkdir -p "$out"/speed
export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 240 python bench/kernel_speed.py --out "$out"/speed 2>&1 | tail -80
timeout 150 python bench/kernels_check.py --quick --ms 1,3,16,21,45,77,300 > "$out"/kernels_check.txt 2>&1; tail -3 "$out"/kernels_check.txt
timeout 90 python bench/kernels_e2e.py --work /tmp/e2e --out "$out"/e2e.json 2>&1 | tail -8
timeout 100 python bench/decode_speed.py --work /tmp/decode --out "$out"/decode.json 2>&1 | tail -8
