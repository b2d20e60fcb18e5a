#!/bin/bash
# The published kernel figures (BENCHMARKS.md, "Kernels"), in two device calls of under 10 minutes:
#   bash bench/final_gpu_run.sh OUTDIR a    # table + plot (kernels.py), end to end (kernels_e2e.py): runs 37, 41, 59, 63
#   bash bench/final_gpu_run.sh OUTDIR b    # correctness (kernels_check.py), decode speed (decode_speed.py): runs 39, 41, 42, 64
out=${1:?usage: bench/final_gpu_run.sh OUTDIR a|b}
part=${2:?usage: bench/final_gpu_run.sh OUTDIR a|b}
mkdir -p "$out"/speed
export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$part" = a ]; then
  timeout 330 python bench/kernels.py --ms 1,2,4,8,16,32,64,128,256,512,1024 --out "$out"/speed 2>&1 | tail -80
  timeout 200 python bench/kernels_e2e.py --work /tmp/e2e --out "$out"/e2e.json 2>&1 | tail -8
else
  timeout 280 python bench/decode_speed.py --work /tmp/decode --out "$out"/decode.json 2>&1 | tail -14
  timeout 280 python bench/kernels_check.py --quick --ms 1,3,16,21,30,45,64,77,130,300,500 > "$out"/kernels_check.txt 2>&1
  echo "kernels_check exit $?"; tail -3 "$out"/kernels_check.txt
fi
