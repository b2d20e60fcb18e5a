"""The kernel configurations the dispatch table is chosen from, and the tuning run that chooses.

`tune` times every candidate at each M on the four Llama-2-7B shapes (CUDA-graph replay, weight ring)
and keeps, per M, the one with the least time summed over the shapes: what a decoder layer pays.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.lib.kernel_timing import graph_us, ring_size
from quantkit.kernels import dispatch
from quantkit.kernels.triton_layout import KernelWeights

SHAPES = {"qkv": (4096, 12288), "o": (4096, 4096), "gate_up": (4096, 22016), "down": (11008, 4096)}


def random_kw(k: int, n: int, bits: int, group_size: int) -> KernelWeights:
    """Random weights already in the kernel layout (timing needs realistic bytes, not values)."""
    gs = k if group_size == -1 else group_size
    g = k // gs
    return KernelWeights(
        qweight=torch.randint(-(2**31), 2**31 - 1, (n, k * bits // 32), dtype=torch.int32, device="cuda"),
        scales=(torch.rand(n, g, device="cuda") * 0.01 + 0.001).half(),
        zeros=torch.randint(0, 2**bits, (n, g), dtype=torch.uint8, device="cuda"),
        bits=bits, group_size=gs, in_features=k, out_features=n,
    )


def _gemv(bn, nb, nw, programs, stages=1):
    return dispatch.Choice("gemv", dict(block_n=bn, blocks=nb, num_warps=nw, num_stages=stages), programs)


def _gemm(bm, bn, nb, nw, ns, swap, programs):
    return dispatch.Choice("gemm", dict(block_m=bm, block_n=bn, blocks=nb, num_warps=nw, num_stages=ns, swap_ab=swap),
                           programs)


# GEMV tiles (block_n, blocks, warps, cp.async stages). Run 4 of bench/KERNELS_NOTES.md also timed
# (16, 16, 4, 1–3), (32, 16, 8, 2–3) and (16, 8, 4, 3–4): never faster, dropped to save tuning time.
# (32, 16, 2, 2–3), the tuned tile with cp.async stages, has not been timed yet.
GEMV_TILES = ((32, 16, 2, 1), (32, 16, 2, 2), (32, 16, 2, 3), (32, 16, 4, 2), (64, 16, 8, 2))


def candidates(bits: int, m: int) -> list[dispatch.Choice]:
    """Configurations worth timing at this M (kept small: every one costs a compile on the GPU)."""
    out: list[dispatch.Choice] = []
    if m == 1:
        out += [_gemv(bn, nb, nw, p, st) for bn, nb, nw, st in GEMV_TILES for p in (4, 8)]
    elif m <= 8:
        out += [_gemv(bn, nb, nw, 4, st) for bn, nb, nw, st in GEMV_TILES]
    if 2 <= m <= 64:
        bm = max(16, 1 << (m - 1).bit_length())
        out += [_gemm(bm, 64, 8, 4, 3, True, p) for p in (2, 4)]
    if m >= 16:
        out.append(dispatch.Choice("dequant+cublas"))
    return out


def tune(ms, w8_ms, log_path: Path) -> dict:
    """Time the candidates; return the dispatch table's block-planar rows ("w{bits} block-planar" → [(largest M,
    choice as a dict)]), the format dispatch_table.replaced_rows takes."""
    log = open(log_path, "w")
    table: dict = {}
    for bits, bit_ms in ((4, ms), (8, w8_ms)):
        gs = 128 if bits == 4 else -1
        rings = {}
        for shape, (k, n) in SHAPES.items():
            first = random_kw(k, n, bits, gs)
            rings[shape] = [first] + [random_kw(k, n, bits, gs) for _ in range(ring_size(first.nbytes) - 1)]
        rows = []
        for m in bit_ms:
            xs = {s: torch.randn(m, SHAPES[s][0], device="cuda", dtype=torch.float16) for s in SHAPES}
            best, best_us = None, float("inf")
            for choice in candidates(bits, m):
                per_shape = {}
                try:
                    for shape, ring in rings.items():
                        x = xs[shape]
                        per_shape[shape] = graph_us([lambda kw=kw, x=x: dispatch.run(x, kw, None, choice) for kw in ring])
                except Exception as exc:  # a configuration that does not compile here is skipped, and logged
                    log.write(json.dumps({"bits": bits, "m": m, "choice": choice.__dict__, "error": str(exc)[:300]}) + "\n")
                    continue
                total = sum(per_shape.values())
                log.write(json.dumps({"bits": bits, "m": m, "choice": choice.__dict__, "us": per_shape, "total": total}) + "\n")
                log.flush()
                if total < best_us:
                    best, best_us = choice, total
            print(f"tune W{bits} M={m}: {best.method} {best.params} programs={best.programs} total {best_us:.1f} us", flush=True)
            rows.append([m, best.__dict__])
        rows[-1][0] = 1 << 30
        table[f"w{bits} block-planar"] = rows
        del rings
        torch.cuda.empty_cache()
    log.close()
    return table
