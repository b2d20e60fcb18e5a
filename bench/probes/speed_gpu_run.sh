#!/bin/bash
# Issue #26's profile on one GPU, one device call (timeouts per part); results under OUTDIR:
#   bash bench/probes/speed_gpu_run.sh OUTDIR "load offline step latency2k attention"
# load:      closed loop at c1/c16/c64 (as `bench serve`, no HTTP), W4 at budgets 2048 and 8192, fp16 at 2048,
#            two passes each, every step timed in its parts (bench/probes/throughput_profile.py)
# offline:   eager kernels per step kind at c64 (budget 2048) under torch.profiler
# step:      batch-1 decode step: Engine.step vs graph replay, eager kernels (bench/probes/engine_step_profile.py)
# latency2k: batch 1 after a 2,048-token prompt (prefill rate = 2048 / TTFT, decode at context), W4 and fp16
# attention: the paged decode-attention kernel at b1/b32 × 2k/4k, KV 16/8 (bench/probes/paged_attention.py)
# gputest:   the engine's GPU tests (graphs, piecewise prefill graphs)
# loadab:    the closed loop, W4, budget 2048, piecewise graphs off (0) and on (2048); loadfp16: fp16, on
# throughput: bench.throughput 7B W4 512 × 512/128, KV16;  seed: bench.latency --seed-table
out=${1:?usage: bench/probes/speed_gpu_run.sh OUTDIR PARTS}
parts=${2:-"load offline step latency2k attention"}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
has() { [[ " $parts " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if has load; then
  stamp load w4
  timeout 240 python -m bench.probes.throughput_profile --weights w4 --budgets 2048,8192 --concurrency 1,16,64 \
    --passes 2 --out "$out"/load_w4.json 2>&1 | grep -v "it/s"
  stamp load fp16
  timeout 120 python -m bench.probes.throughput_profile --weights fp16 --budgets 2048 --concurrency 1,16,64 \
    --passes 2 --out "$out"/load_fp16.json 2>&1 | grep -v "it/s"
fi
if has offline; then
  stamp offline profile
  timeout 150 python -m bench.probes.throughput_profile --weights w4 --budgets 2048 --concurrency 64 --profile \
    --out "$out"/profile_c64.json 2>&1 | grep -v "it/s"
fi
if has step; then
  stamp step
  timeout 90 python -m bench.probes.engine_step_profile --top 16 2>&1 | grep -v "it/s"
fi
if has latency2k; then
  stamp latency2k
  timeout 150 python -m bench.latency --shapes llama2-7b --weights w4,fp16 --input-len 2048 --output-len 128 \
    --out "$out"/latency2k.json 2>&1 | grep -v "it/s" | tail -8
fi
if has attention; then
  stamp attention
  timeout 90 python bench/probes/paged_attention.py --shape llama2-7b --batches 1,32 --contexts 2048,4096 \
    --max-model-len 4096 2>&1 | tail -20
fi
if has gputest; then
  stamp gputest
  timeout 200 python -m pytest -q -m gpu tests/gpu/test_gpu_engine.py -x 2>&1 | tail -8
fi
if has loadab; then
  stamp loadab
  timeout 240 python -m bench.probes.throughput_profile --weights w4 --budgets 2048 --graph-max-tokens 0,2048 \
    --concurrency 1,16,64 --passes 2 --out "$out"/loadab_w4.json 2>&1 | grep "=="
fi
if has loadfp16; then
  stamp loadfp16
  timeout 150 python -m bench.probes.throughput_profile --weights fp16 --budgets 2048 --graph-max-tokens 2048 \
    --concurrency 1,16,64 --passes 2 --out "$out"/loadab_fp16.json 2>&1 | grep "=="
fi
if has throughput; then
  stamp throughput
  timeout 150 python -m bench.throughput --kv-bits 16 --out "$out"/throughput.json 2>&1 | grep -v "it/s" | tail -4
fi
if has seed; then
  stamp seed
  timeout 280 python -m bench.latency --seed-table --out "$out"/seed.json 2>&1 | grep -v "it/s" | tail -14
fi
if has kv8sweep; then
  stamp kv8sweep
  timeout 150 python bench/probes/paged_attention.py --shape llama2-7b --batches 32 --contexts 4096 --bits 8 \
    --max-model-len 4096 --sweep 2>&1 | tail -40
fi
if has c64ab; then
  stamp c64ab
  timeout 120 python -m bench.probes.throughput_profile --weights w4 --budgets 2048 --graph-max-tokens 0,2048 \
    --concurrency 64 --passes 1 --out "$out"/c64ab_w4.json 2>&1 | grep "==\|KV pool"
fi
if has kerneltests; then
  stamp kerneltests
  timeout 90 python -m pytest -q -m gpu tests/gpu/test_gpu_kernels.py -x 2>&1 | tail -4
fi
stamp done
