"""W4A16 / W8A16 kernels against torch fp16 F.linear and torch's int4 kernel at Llama-2-7B shapes (H200).

    PYTHONPATH=. python bench/kernel_speed.py --out DIR [--tune] [--table table.json]

--tune first times every candidate kernel configuration (bench/lib/kernel_candidates.py) summed over the
four shapes, per M, and installs the fastest as the dispatch table (written to DIR/table.json, then
copied into quantkit/kernels/dispatch_table.py). The benchmark proper goes through dispatch.run with the
layout and kernel choice the runtime gives such a layer (on CUDA the mma layout and
dispatch.mma_choice; --block-planar times the block-planar kernels and their table instead). Times
are medians over CUDA-graph replays, every call on a different weight buffer of a ring several times
the L2 size; plain (eager) launch times are reported beside them, and for the
mma GEMV the other launch mode (programmatic dependent launch when it is off, as by default, or
without it under QUANTKIT_PDL=1). The kernels are compiled first by a pool of processes. Writes
DIR/kernels.json, DIR/kernels.md and DIR/kernels_speedup.png.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.lib.kernel_candidates import SHAPES, random_kw, tune
from bench.lib.kernel_timing import copy_bandwidth, graph_us, plain_us, ring_size
from quantkit.kernels import dispatch, triton_mma
from quantkit.kernels.settings import KernelSettings
from quantkit.kernels.triton_mma import MmaWeights

MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
W8_MS = (1, 16, 64, 128, 256, 512, 1024)


def runtime_layout(kw):
    """The layout the runtime gives such a layer on this GPU with fp16 activations (the mma layout
    unless --block-planar), as dispatch.kernel_weights does."""
    if BLOCK_PLANAR or not triton_mma.supports(kw.bits, kw.group_size, kw.in_features, kw.scales.shape[1],
                                               torch.float16):
        return kw
    return triton_mma.from_kernel_weights(kw)


BLOCK_PLANAR = False
KERNELS = KernelSettings.from_env()  # --table / --tune replace the dispatch table's rows here


def int4_ring(k: int, n: int):
    """torch's tinygemm int4 weights (g128) as a ring, and its bytes; bf16 activations only."""
    def one():
        w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        return torch._convert_weight_to_int4pack(w, 8), torch.rand(k // 128, n, 2, device="cuda", dtype=torch.bfloat16)
    nbytes = n * k // 2 + (k // 128) * n * 4
    return [one() for _ in range(ring_size(nbytes))], nbytes


def measure(calls_of, ring, nbytes, m, k, n):
    calls = [lambda w=w: calls_of(w) for w in ring]
    g = graph_us(calls)
    p = plain_us(calls)
    return {"us": g, "plain_us": p, "tbps": (nbytes + 2 * m * (k + n)) / g / 1e6}


def bench_shape(shape: str, copy_tbps: float, results: list, w4_ms=MS, w8_ms=W8_MS) -> None:
    k, n = SHAPES[shape]
    fp16 = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(ring_size(n * k * 2))]
    try:
        i4, i4_bytes = int4_ring(k, n)
    except Exception as exc:  # a torch without the tinygemm kernel: report, keep going
        print(f"torch int4 unavailable: {exc}")
        i4, i4_bytes = None, 0
    for bits, ms in ((4, w4_ms), (8, w8_ms)):
        gs = 128 if bits == 4 else -1
        kws = [runtime_layout(random_kw(k, n, bits, gs))]
        kws += [runtime_layout(random_kw(k, n, bits, gs)) for _ in range(ring_size(kws[0].nbytes) - 1)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            choice = dispatch.choice_for(kws[0], m, x.device, graphed=True, kernels=KERNELS)
            named = (("w", "num_warps"), ("t", "tiles"), ("b", "bm"), ("s", "stages"), ("r", "rows"),
                     ("split", "split"))
            params = "".join(f" {a}{choice.params[key]}" for a, key in named if choice.params.get(key))
            row = {"shape": shape, "K": k, "N": n, "bits": bits, "m": m,
                   "kernel": choice.method + params + (" pdl" if choice.params.get("pdl") else ""),
                   "ours": measure(lambda kw: dispatch.run(x, kw, None, choice), kws, kws[0].nbytes, m, k, n),
                   "fp16": measure(lambda w: F.linear(x, w), fp16, n * k * 2, m, k, n)}
            if bits == 4 and i4 is not None:
                xb = x.bfloat16()
                row["int4"] = measure(lambda p: torch._weight_int4pack_mm(xb, p[0], 128, p[1]), i4, i4_bytes, m, k, n)
            pdl_choice = (dispatch.mma_choice(bits, m, n, pdl=True, table=KERNELS.dispatch_rows())
                          if isinstance(kws[0], MmaWeights) else choice)
            if choice.method == "mma" and pdl_choice.params.get("pdl") and not choice.params.get("pdl"):
                # the opt-in (QUANTKIT_PDL=1): programmatic dependent launch, back to back
                row["ours_pdl"] = measure(lambda kw: dispatch.run(x, kw, None, pdl_choice), kws, kws[0].nbytes, m, k, n)
            if choice.params.get("pdl"):  # the same kernel launched without programmatic dependent launch
                plain = dispatch.Choice(choice.method, {**choice.params, "pdl": False}, choice.programs)
                row["ours_no_pdl"] = measure(lambda kw: dispatch.run(x, kw, None, plain), kws, kws[0].nbytes, m, k, n)
            row["speedup"] = row["fp16"]["us"] / row["ours"]["us"]
            row["copy_pct"] = 100 * row["ours"]["tbps"] / copy_tbps
            results.append(row)
            i4s = f"{row['int4']['us']:7.1f}" if "int4" in row else "    n/a"
            npd = f" (no PDL {row['ours_no_pdl']['us']:.1f})" if "ours_no_pdl" in row else ""
            npd += f" (PDL {row['ours_pdl']['us']:.1f})" if "ours_pdl" in row else ""
            print(f"W{bits} {shape:7} M={m:4} ours {row['ours']['us']:7.1f}us{npd} "
                  f"({row['ours']['plain_us']:6.1f} plain) "
                  f"{row['ours']['tbps']:.2f}TB/s {row['copy_pct']:4.0f}% | fp16 {row['fp16']['us']:7.1f} | int4 {i4s} "
                  f"| x{row['speedup']:.2f} {choice.method}", flush=True)
        del kws
        torch.cuda.empty_cache()


def precompile(ms, w8_ms, workers: int = 15) -> None:
    """Compile the mma GEMVs the dispatch picks here (with and without PDL) in parallel processes."""
    import multiprocessing as mp

    from bench.lib.kernels_mma import _compile_one

    if BLOCK_PLANAR:
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    jobs = {}
    for k, n in SHAPES.values():
        for bits, bm in ((4, ms), (8, w8_ms)):
            for m in bm:
                c = dispatch.mma_choice(bits, m, n, sms, pdl=True, table=KERNELS.dispatch_rows())
                if c.method == "mma":
                    for p in (c.params, {**c.params, "pdl": False}):
                        jobs[repr((bits, k, m, p))] = (bits, k, m, p)
    t0 = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        errors = [e for e in pool.map(_compile_one, list(jobs.values()), chunksize=1) if e]
    print(f"precompiled {len(jobs)} kernels in {time.time() - t0:.0f} s, {len(errors)} failed: {errors[:3]}",
          flush=True)


def markdown(results: list, copy_tbps: float) -> str:
    """The rows as a table: µs (plain launches), effective TB/s and % of the copy bandwidth per method."""
    lines = [f"copy bandwidth {copy_tbps:.2f} TB/s", "",
             "| W | shape (K×N) | M | kernel | ours µs (plain) | TB/s (% copy) | fp16 µs (plain) | TB/s (% copy) "
             "| torch int4 µs (plain) | TB/s (% copy) | ours × fp16 | int4 × fp16 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines[2] = lines[2].replace("| ours µs (plain) |", "| ours µs (plain) [PDL] |")

    def cells(t: dict | None) -> str:
        if t is None:
            return "– | –"
        return f"{t['us']:.1f} ({t['plain_us']:.1f}) | {t['tbps']:.2f} ({100 * t['tbps'] / copy_tbps:.0f} %)"

    for r in results:
        f, i4 = r["fp16"], r.get("int4")
        i4_x = f"{f['us'] / i4['us']:.2f}" if i4 else "–"
        ours = cells(r["ours"])
        for key in ("ours_pdl", "ours_no_pdl"):  # the other launch mode, whichever the run did not default to
            if key in r:
                us, rest = ours.split(" | ")
                ours = f"{us} [{r[key]['us']:.1f}] | {rest}"
        lines.append(f"| {r['bits']} | {r['shape']} {r['K']}×{r['N']} | {r['m']} | {r['kernel']} | {ours} "
                     f"| {cells(f)} | {cells(i4)} | {r['speedup']:.2f} | {i4_x} |")
    return "\n".join(lines)


def plot(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for shape in SHAPES:
        for bits, style in ((4, "-o"), (8, ":s")):
            rows = [r for r in results if r["shape"] == shape and r["bits"] == bits]
            if rows:
                ax.plot([r["m"] for r in rows], [r["speedup"] for r in rows], style, label=f"W{bits} {shape}")
        rows = [r for r in results if r["shape"] == shape and r["bits"] == 4 and "int4" in r]
        ax.plot([r["m"] for r in rows], [r["fp16"]["us"] / r["int4"]["us"] for r in rows], "--", alpha=0.5,
                label=f"torch int4 {shape}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("speed-up over fp16 F.linear")
    ax.set_title("quantkit Triton W4A16 g128 / W8A16 vs fp16, H200, CUDA-graph replay")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--table", default=None, help="a dispatch table JSON whose rows replace the built-in ones")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="M values for W4")
    ap.add_argument("--w8-ms", default=",".join(map(str, W8_MS)), help="M values for W8")
    ap.add_argument("--block-planar", action="store_true",
                    help="time the block-planar kernels (the dispatch table) instead of the mma layout")
    args = ap.parse_args()
    global BLOCK_PLANAR, KERNELS
    BLOCK_PLANAR = args.block_planar
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ms = [int(v) for v in args.ms.split(",")]
    w8_ms = [int(v) for v in args.w8_ms.split(",")]
    t0 = time.time()
    copy_tbps = copy_bandwidth()
    print(f"copy bandwidth {copy_tbps:.2f} TB/s; {torch.cuda.get_device_name()}", flush=True)
    if args.table:
        KERNELS = dataclasses.replace(KERNELS, table=str(Path(args.table).resolve()))
    if args.tune:
        table = tune(ms, w8_ms, out / "tune.jsonl")
        (out / "table.json").write_text(json.dumps(table, indent=1))
        KERNELS = dataclasses.replace(KERNELS, table=str((out / "table.json").resolve()))
        print(f"tuned in {time.time() - t0:.0f} s", flush=True)
    precompile(ms, w8_ms)
    results: list = []
    for shape in SHAPES:
        bench_shape(shape, copy_tbps, results, ms, w8_ms)
    (out / "kernels.json").write_text(json.dumps({"copy_tbps": copy_tbps, "rows": results}, indent=1))
    (out / "kernels.md").write_text(markdown(results, copy_tbps))
    plot(results, out / "kernels_speedup.png")
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
