#!/bin/bash
# The published kernel figures (BENCHMARKS.md, "Kernels"), in three device calls of under 10 minutes:
#   bash bench/probes/final_gpu_run.sh OUTDIR a    # table + plot (kernels.py), end to end (kernels_e2e.py): runs 37, 41, 59, 63
#   bash bench/probes/final_gpu_run.sh OUTDIR b    # W4 correctness (kernels_check.py): runs 39, 41, 42, 64
#   (decode speed came from decode_speed.py, removed with the transformers-graph decode loop it timed:
#   the engine's speed is `quantkit bench latency`)
#   bash bench/probes/final_gpu_run.sh OUTDIR c    # W8 correctness (kernels_check.py --bits 8)
#   bash bench/probes/final_gpu_run.sh OUTDIR q    # probes: producer warp (gluon_ws.py, run 75), read-only floor (read_floor.py, run 78)
out=${1:?usage: bench/probes/final_gpu_run.sh OUTDIR a|b|c|q}
part=${2:?usage: bench/probes/final_gpu_run.sh OUTDIR a|b|c|q}
mkdir -p "$out"/speed
export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$part" = a ]; then
  timeout 330 python bench/kernel_speed.py --ms 1,2,4,8,16,32,64,128,256,512,1024 --out "$out"/speed 2>&1 | tail -80
  timeout 200 python bench/kernels_e2e.py --work /tmp/e2e --out "$out"/e2e.json 2>&1 | tail -8
elif [ "$part" = b ]; then
  timeout 320 python bench/kernels_check.py --quick --bits 4 --ms 1,3,16,21,30,45,64,77,130,300,500 > "$out"/kernels_check_w4.txt 2>&1
  echo "kernels_check exit $?"; tail -3 "$out"/kernels_check_w4.txt
elif [ "$part" = q ]; then  # bench/KERNELS_NOTES.md items 76 and 79
  timeout 280 python bench/probes/gluon_ws.py --ms 64,128,256,512,1024 --out "$out"/ws4 > "$out"/gluon_ws_w4.txt 2>&1
  echo "gluon_ws exit $?"; grep -E "^check:|Error" "$out"/gluon_ws_w4.txt | head -5; grep -v "^check" "$out"/gluon_ws_w4.txt | tail -20
  timeout 200 python bench/probes/read_floor.py --out "$out"/floor 2>&1 | tail -12
else
  timeout 500 python bench/kernels_check.py --quick --bits 8 --ms 1,3,16,21,30,45,64,77,130,300,500 > "$out"/kernels_check_w8.txt 2>&1
  echo "kernels_check exit $?"; tail -3 "$out"/kernels_check_w8.txt
fi
