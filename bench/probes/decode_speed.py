"""Decode speed of a random-weight Llama-2-7B-shape model on the GPU: fp16 vs W4 g128, eager vs CUDA graphs.

Builds the model on the GPU from a config (32 layers by default), writes its RTN W4 g128 AWQ checkpoint
with quantkit's exporter (bench/kernels_e2e.py), loads it with `quantkit.load`, and times greedy
generation of `--new` tokens after a `--prompt`-token random prompt at batch 1 (and `--batch`):

- transformers' `generate` (dynamic cache, eager launches), fp16 and W4;
- quantkit's static-cache loop (`quantkit.runtime.decode.generate`) eager and with CUDA-graph replay.

Also checks that graph replay gives exactly the tokens of the same loop run eagerly. Tokens/s count
new tokens only, after one warm-up run of each variant; wall time by CUDA synchronisation.

    PYTHONPATH=. python bench/probes/decode_speed.py --work /tmp/decode --out decode.json [--layers 32]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.kernels_e2e import build_checkpoint
from quantkit.runtime.decode import generate


def timed(fn, reps: int = 2) -> tuple[float, torch.Tensor]:
    fn()  # warm-up: compiles kernels, captures graphs of its own run
    torch.cuda.synchronize()
    best, out = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/quantkit-decode")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import quantkit

    t0 = time.time()
    fp16_model, path = build_checkpoint(Path(args.work), args.layers)
    qmodel, _ = quantkit.load(path, device="cuda")
    print(f"built, written and loaded in {time.time() - t0:.0f} s", flush=True)
    os.environ["QUANTKIT_KERNEL"] = "triton"
    result: dict = {"layers": args.layers, "prompt": args.prompt, "new": args.new,
                    "gpu": torch.cuda.get_device_name()}
    g = torch.Generator(device="cuda").manual_seed(0)
    for batch in (1, args.batch):
        ids = torch.randint(3, 32000, (batch, args.prompt), device="cuda", generator=g)
        mask = torch.ones_like(ids)
        rows = {}
        with torch.inference_mode():
            for name, model in (("fp16", fp16_model), ("w4", qmodel)):
                hf = lambda m=model: m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new,
                                                min_new_tokens=args.new, do_sample=False, pad_token_id=0)
                eager = lambda m=model: generate(m, ids, mask, args.new, use_graph=False)
                graph = lambda m=model: generate(m, ids, mask, args.new, use_graph=True)
                for variant, fn in (("hf_generate", hf), ("static_eager", eager), ("static_graph", graph)):
                    sec, out = timed(fn)
                    rows[f"{name}_{variant}"] = {"s": sec, "tok_per_s": batch * args.new / sec, "tokens": out[:, args.prompt:]}
                    print(f"batch {batch} {name:4} {variant:12} {sec * 1e3:8.1f} ms  {batch * args.new / sec:8.1f} tok/s", flush=True)
        res = {k: {"s": v["s"], "tok_per_s": v["tok_per_s"]} for k, v in rows.items()}
        for name in ("fp16", "w4"):
            res[f"{name}_graph_equals_eager"] = bool(torch.equal(rows[f"{name}_static_graph"]["tokens"], rows[f"{name}_static_eager"]["tokens"]))
            res[f"{name}_static_vs_hf_token_agreement"] = float(
                (rows[f"{name}_static_eager"]["tokens"] == rows[f"{name}_hf_generate"]["tokens"]).float().mean())
        res["w4_graph_speedup_over_fp16_graph"] = res["w4_static_graph"]["tok_per_s"] / res["fp16_static_graph"]["tok_per_s"]
        res["w4_graph_speedup_over_fp16_hf"] = res["w4_static_graph"]["tok_per_s"] / res["fp16_hf_generate"]["tok_per_s"]
        result[f"batch{batch}"] = res
    result["max_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
