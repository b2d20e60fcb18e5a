"""Probe: GPTQ rounding's column loop replayed from CUDA graphs gives the eager loop's codes, and its time.

    PYTHONPATH=. python -m bench.probes.gptq_graph_check     # needs CUDA

Llama-2-7B shapes (stacked q/k/v, o, stacked gate/up, down), random weights with a correlated Gram
matrix, AWQ-style asymmetric W4 g128 scales/zeros. Prints, per shape, whether the codes are equal
and the seconds of each path.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import time

import torch

from quantkit.config import WeightQuantConfig
from quantkit.quantize.primitives import quantize_weight
from quantkit.quantize.rounding import gptq_codes

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate+up": (22016, 4096), "down": (4096, 11008)}


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    torch.manual_seed(0)
    cfg = WeightQuantConfig(4, 128)
    for name, (rows, cols) in SHAPES.items():
        w = torch.randn(rows, cols, device="cuda") * 0.02
        x = torch.randn(4096, 64, device="cuda") @ torch.randn(64, cols, device="cuda") + torch.randn(4096, cols, device="cuda")
        h = x.t() @ x
        qw = quantize_weight(w, cfg)
        gptq_codes(w, h, qw.scales, qw.zeros, 4, 128, graphs=True)  # capture once, as a pass does
        graphed, t_graph = timed(lambda: gptq_codes(w, h, qw.scales, qw.zeros, 4, 128, graphs=True))
        eager, t_eager = timed(lambda: gptq_codes(w, h, qw.scales, qw.zeros, 4, 128, graphs=False))
        print(f"{name} {rows}x{cols}: equal={torch.equal(graphed, eager)} graphed {t_graph:.3f}s eager {t_eager:.3f}s",
              flush=True)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    main()
