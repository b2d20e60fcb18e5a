#!/bin/bash
# Issues #27 and #28 on one GPU, in device calls that share a warm machine (timeouts per part); results under OUTDIR:
#   bash bench/probes/kv_learned_gpu_run.sh OUTDIR "stash_a gputest learned7b capacity"
#   bash bench/probes/kv_learned_gpu_run.sh OUTDIR "kvquality"
# A checkpoint larger than one call may carry travels in two: `stash_a` keeps .big/part_a on the machine
# (/tmp/qk_stash), `kvquality` joins it with the next call's .big/part_b* into the SmolLM2 AWQ W4 g64 export
# made on the CPU (bench.kv_quality's), so the GPU evaluates the very checkpoint the CPU did.
# gputest:   every GPU test (kernels after the dispatch rewrite, engine, paged KV incl. rotation)
# learned7b: `quantkit awq --rounding learned` on a Llama-2-7B-shape checkpoint (bench.learned_rounding --speed)
# capacity:  KV pool tokens at 16/8/4 bits (bench.long_context --part capacity)
# longctx:   decode at b32 × 4k, KV 16/8/4 (bench.long_context --cases b32-4k)
# attention: the decode-attention kernels at b1/b32 × 4k, KV 16/8/4 (bench/probes/paged_attention.py)
# kvquality: PTB / WikiText-2 perplexity, KL and top-1 of KV16 / KV8 / KV4 (plain and rotated) through the engine
out=${1:?usage: bench/probes/kv_learned_gpu_run.sh OUTDIR PARTS}
parts=${2:?parts}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
has() { [[ " $parts " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
stash=/tmp/qk_stash
if has stash_a; then
  mkdir -p $stash && cp .big/part_a $stash/ && stamp stashed $(ls -la $stash)
fi
if has gputest; then
  stamp gputest
  timeout 240 python -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -12
fi
if has learned7b; then
  stamp learned7b
  timeout 450 python -m bench.learned_rounding --speed 7b --root /tmp/qk-learned --timeout 430 \
    --json "$out"/learned_7b.json 2>&1 | grep -v "it/s" | grep -v '^    "' | tail -40
fi
if has capacity; then
  stamp capacity
  timeout 120 python -m bench.long_context --part capacity --out "$out"/capacity.json 2>&1 | grep -v "it/s" | tail -6
fi
if has longctx; then
  stamp longctx
  timeout 200 python -m bench.long_context --part long --cases b32-4k --out "$out"/long_b32.json 2>&1 | grep -v "it/s" | tail -6
fi
if has attention; then
  stamp attention
  timeout 180 python bench/probes/paged_attention.py --shape llama2-7b --batches 1,32 --contexts 4096 \
    --max-model-len 4096 --bits 16,8,4 2>&1 | tail -30
fi
if has kvquality; then
  stamp kvquality
  # ../shared does not travel: the test texts come in .big/data (ptb.test.txt, wiki2.test.txt)
  export QUANTKIT_DATA_DIR=${QUANTKIT_DATA_DIR:-$PWD/.big/data}
  model=/tmp/qk_smollm2/awq-w4g64
  mkdir -p $model && cat $stash/part_a .big/part_b > $model/model.safetensors && tar -xzf .big/rest.tgz -C $model \
    && ls -la $model && sha256sum $model/model.safetensors
  timeout 400 python -m bench.kv_quality --model $model --device cuda --settings 16,8,4:none,4 \
    --json "$out"/kv_quality_cuda.json 2>&1 | grep -v "it/s" | tail -14
fi
stamp done
