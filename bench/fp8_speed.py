"""FP8 (e4m3) W8A8 against fp16 and W4 on the GPU: the linears, a 2,048-token prefill, batch-1 decode.

    PYTHONPATH=. python -m bench.fp8_speed --part kernels --tune --out DIR   # the linears; DIR/fp8_table.json
    QUANTKIT_DISPATCH_TABLE=DIR/fp8_table.json PYTHONPATH=. python -m bench.fp8_speed --part engine --out DIR

--part kernels: the four Llama-2-7B linears at M = 1 … 8,192: fp16 F.linear against the FP8 linear
*including the per-token activation quantization* (the quantize kernel, then the product the dispatch
table picks), each candidate product (the Triton swap-AB kernel's configurations, cuBLAS's
torch._scaled_mm) checked against the torch emulation and timed as CUDA-graph medians on a ring of
weights larger than L2. --tune writes the fastest product per M and layer class as dispatch-table rows
(DIR/fp8_table.json, for QUANTKIT_DISPATCH_TABLE, then copied into quantkit/kernels/dispatch_table.py).
--part engine: random-weight Llama-2-7B models, fp16 / W4 / FP8 in one process: the prefill of a
2,048-token prompt at batch 1 (2,048 / time to first token) and batch-1 decode (bench.latency's rule).
Writes DIR/fp8_kernels.json or DIR/fp8_engine.json.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import json
import math
import time
from pathlib import Path

LLAMA2_7B = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}  # n, k
MS = (1, 16, 32, 64, 128, 256, 512, 1024, 2048, 8192)
DOT_MS = (1, 16, 32, 64, 128, 256)  # where the Triton kernel is a candidate


def dot_candidates(m: int) -> list[dict]:
    block_ms = [16] if m <= 16 else [16, 32] if m <= 32 else [32, 64] if m <= 64 else [64, 128]
    return [dict(block_n=bn, block_m=bm, block_k=128, split_k=sk, num_warps=4, num_stages=4)
            for bn in (64, 128) for bm in block_ms for sk in (1, 2, 4, 8)]


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def kernels_part(args) -> dict:
    import torch
    import torch.nn.functional as F

    from bench.lib.kernel_timing import graph_us, rel_err, ring_size
    from quantkit.kernels import fp8, reference, triton_fp8
    from quantkit.kernels.dispatch_table import ANY, SCALED_MM, Choice, width_class
    from quantkit.kernels.settings import KernelSettings

    kernels = KernelSettings.from_env()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, best = [], {}  # best[(class, m)] = [(us, choice)] summed over the class's layers
    for name, (n, k) in LLAMA2_7B.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        w16 = [torch.randn(n, k, device="cuda", generator=g, dtype=torch.float16) * 0.02
               for _ in range(ring_size(n * k * 2))]
        scale = w16[0].float().abs().amax(dim=1, keepdim=True) / 448
        w8 = [reference.encode_e4m3(torch.randn(n, k, device="cuda", generator=g) * 0.02, scale)
              for _ in range(ring_size(n * k))]
        emulated_w = reference.dequantize_fp8(w8[0], scale)
        cls = width_class(n, k, sms)
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            q, s = triton_fp8.quantize(x, None)
            want = F.linear(q.float() * s, emulated_w).half()
            fp16_us = graph_us([lambda w=w: F.linear(x, w) for w in w16])
            quant_us = graph_us([lambda: triton_fp8.quantize(x, None)])
            cands = [(SCALED_MM, lambda w: fp8.scaled_mm(q, s, w, scale, None, torch.float16))]
            if m <= DOT_MS[-1]:
                cands += [(Choice("fp8-dot", p), lambda w, p=p: triton_fp8.dot(q, s, w, scale, None, torch.float16, **p))
                          for p in dot_candidates(m)]
            timed = []
            for choice, fn in cands:
                err = rel_err(fn(w8[0]), want)
                if err > 2e-3:
                    print(f"  {name} M={m} {choice.method} {choice.params}: rel. err {err:.2e}, left out")
                    continue
                timed.append((graph_us([lambda w=w, fn=fn: fn(w) for w in w8]), choice, err))
            timed.sort(key=lambda t: t[0])
            table_choice = fp8.choice_for(m, n, k, x.device, kernels)
            table_us = next((us for us, c, _ in timed if c == table_choice), None)
            for us, choice, _ in timed:
                acc = best.setdefault((cls, m), {})
                key = json.dumps([choice.method, choice.params], sort_keys=True)
                acc[key] = acc.get(key, (0.0, choice, 0))
                acc[key] = (acc[key][0] + us, choice, acc[key][2] + 1)
            top_us, top, top_err = timed[0]
            row = dict(linear=name, n=n, k=k, m=m, cls=cls, fp16_us=round(fp16_us, 2), quant_us=round(quant_us, 2),
                       best=top.method, best_params=top.params, best_us=round(top_us, 2), best_rel_err=top_err,
                       scaled_mm_us=round(next(us for us, c, _ in timed if c.method == "scaled_mm"), 2),
                       table=table_choice.method, table_us=None if table_us is None else round(table_us, 2),
                       speedup_best=round(fp16_us / (quant_us + top_us), 3),
                       speedup_table=None if table_us is None else round(fp16_us / (quant_us + table_us), 3),
                       fp16_tflops=round(2 * m * n * k / fp16_us / 1e6, 1),
                       fp8_tflops=round(2 * m * n * k / top_us / 1e6, 1))
            rows.append(row)
            print(f"{name:8s} M={m:5d} fp16 {fp16_us:8.1f} µs  quant {quant_us:6.1f}  best {top.method} {top_us:8.1f} "
                  f"{top.params}  scaled_mm {row['scaled_mm_us']:8.1f}  ×{row['speedup_best']:.2f}", flush=True)
        del w16, w8
        torch.cuda.empty_cache()
    summary = {m: round(geomean(r["speedup_best"] for r in rows if r["m"] == m), 3) for m in args.ms}
    print("geometric mean over the four linears, fp16 / (quantize + best FP8 product):", summary)
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows,
           "geomean_speedup_best": summary}
    if args.tune:
        table = {}
        for cls in sorted({c for c, _ in best}):
            chosen = []
            for m in [m for m in args.ms if m <= DOT_MS[-1]]:
                cands = [v for v in best[(cls, m)].values() if v[2] == max(x[2] for x in best[(cls, m)].values())]
                us, choice, _ = min(cands, key=lambda v: v[0])
                chosen.append((m, choice))
            merged = []
            for m, choice in chosen:
                if merged and merged[-1][1] == choice:
                    merged[-1] = (m, choice)
                else:
                    merged.append((m, choice))
            if merged[-1][1].method == "scaled_mm":
                merged.pop()
            merged.append((ANY, SCALED_MM))
            table[f"fp8 {cls}"] = [[b, {"method": c.method, "params": c.params}] for b, c in merged]
        path = Path(args.out) / "fp8_table.json"
        path.write_text(json.dumps(table, indent=1))
        out["table"] = table
        print("dispatch rows:", json.dumps(table))
    return out


def engine_part(args) -> dict:
    import torch

    from quantkit.engine.benchmark import BenchSetup, latency

    rows = []
    for weights in args.weights.split(","):
        setup = BenchSetup(args.shape, weights)
        start = time.perf_counter()
        pre = latency(setup, 2048, 8, runs=3)
        dec = latency(setup, 32, 256, runs=2)
        row = dict(shape=args.shape, weights=weights, prefill_tok_s=round(2048 / (pre["ttft_ms"] / 1e3), 1),
                   prefill_ttft_ms=pre["ttft_ms"], decode_tok_s=dec["decode_tok_s"], decode_ttft_ms=dec["ttft_ms"],
                   cuda_graphs=dec["cuda_graphs"], wall_s=round(time.perf_counter() - start, 1))
        rows.append(row)
        print(row, flush=True)
        torch.cuda.empty_cache()
    base = next((r for r in rows if r["weights"] == "fp16"), None)
    if base:
        for r in rows:
            r["prefill_x_fp16"] = round(r["prefill_tok_s"] / base["prefill_tok_s"], 3)
            r["decode_x_fp16"] = round(r["decode_tok_s"] / base["decode_tok_s"], 3)
    return {"device": torch.cuda.get_device_name(0), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("kernels", "engine"), required=True, help="the linears, or the engine")
    ap.add_argument("--tune", action="store_true", help="write the fastest products as dispatch rows (kernels part)")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="the kernels part's M values (default: %(default)s)")
    ap.add_argument("--shape", default="llama2-7b", help="the engine part's model shape (default llama2-7b)")
    ap.add_argument("--weights", default="fp16,w4,fp8", help="the engine part's weights (default fp16,w4,fp8)")
    ap.add_argument("--out", required=True, help="directory for the JSON (created)")
    args = ap.parse_args()
    args.ms = sorted(int(m) for m in args.ms.split(","))
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.fp8_speed needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or later)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = kernels_part(args) if args.part == "kernels" else engine_part(args)
    (Path(args.out) / f"fp8_{args.part}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
