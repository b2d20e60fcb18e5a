"""Probe for M ≥ 128: dequantize + cuBLAS in row chunks through one reused scratch buffer (run 43: never faster).

    PYTHONPATH=. python bench/probes/large_m_probe.py --out DIR [--chunks 1024,2048,4096] [--ms 128,256,1024]

Today's path (dispatch.run, "dequant+cublas") writes the whole fp16 weight (4× the packed bytes) and
cuBLAS reads it back from DRAM: 35 µs for qkv before the GEMM (bench/KERNELS_NOTES.md, item 31).
Here each chunk of `chunk` output rows is dequantized into the same scratch buffer (16 MB for 2048 ×
4096 fp16, less than the H200's L2) and multiplied at once into its columns of y, so the fp16 weight
should make its round trip through L2 instead of DRAM. A chunk must still give cuBLAS enough tiles to
fill the GPU (M = 1024, 2048 rows: 128 tiles of 128 × 128), so M = 128–256 may lose. Prints and writes
µs per method (CUDA-graph medians over a ring of weights) and the chunked result's error against the
whole-weight path.

Outcome (run 43, bench/KERNELS_NOTES.md item 44, bench/results/large_m_probe_run43.json): no chunk size
beat the whole weight at any M (qkv M = 1024: 169 µs whole, 179–234 µs chunked); not integrated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.lib.kernel_timing import graph_us, rel_err
from bench.lib.kernels_mma import _rings
from quantkit.kernels import dispatch, triton_mma


def chunked(x: torch.Tensor, mw, scratch: torch.Tensor, chunk: int, out: torch.Tensor) -> torch.Tensor:
    """y = x Wᵀ with W dequantized `chunk` rows at a time into `scratch`."""
    n = mw.out_features
    for r0 in range(0, n, chunk):
        r1 = min(r0 + chunk, n)
        w = triton_mma.dequantize(mw, x.dtype, rows=(r0, r1), out=scratch[: r1 - r0])
        torch.mm(x, w.t(), out=out[:, r0:r1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for large_m.json")
    ap.add_argument("--chunks", default="1024,2048,4096", help="rows per chunk (multiples of 16)")
    ap.add_argument("--ms", default="128,256,1024", help="rows of x")
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for bits, ms, shape, k, n, ring, fp16 in _rings(((4, ms), (8, ms))):
        scratch = torch.empty(max(chunks), k, device="cuda", dtype=torch.float16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            out = torch.empty(m, n, device="cuda", dtype=torch.float16)
            row = {"bits": bits, "shape": shape, "m": m,
                   "fp16_us": graph_us([lambda w=w: F.linear(x, w) for w in fp16]),
                   "dequant_cublas_us": graph_us([lambda mw=mw: dispatch.run(x, mw, None, dispatch._CUBLAS)
                                                  for mw in ring])}
            ref = dispatch.run(x, ring[0], None, dispatch._CUBLAS)
            for c in chunks:
                row[f"chunk{c}_us"] = graph_us([lambda mw=mw, c=c: chunked(x, mw, scratch, c, out) for mw in ring])
                row[f"chunk{c}_err"] = rel_err(chunked(x, ring[0], scratch, c, out.clone()), ref)
            rows.append(row)
            print(json.dumps({k_: round(v, 4) if isinstance(v, float) else v for k_, v in row.items()}), flush=True)
    (args.out / "large_m.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
