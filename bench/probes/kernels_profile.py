"""One kernel launch to profile with Nsight Compute, on a Llama-2-7B shape (M = 1 unless --m).

    ncu --kernel-name regex:gemv_kernel --launch-skip 3 --launch-count 1 --set full \\
        python bench/probes/kernels_profile.py [--kernel table|mma] [--shape qkv] [--m 1] [--warps 4] [--tiles 1]

(PYTHONPATH=. from the repository root.) Launches the chosen kernel five times: `table` is the
dispatch table's choice, `mma` the tensor-core GEMV with the given warps, tiles per step
and register budget.
"""

from __future__ import annotations

import argparse

import torch

from bench.lib.kernel_candidates import SHAPES, random_kw
from quantkit.kernels import dispatch, triton_mma


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("table", "mma"), default="table", help="which kernel to launch")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="qkv", help="Llama-2-7B linear")
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8), help="weight bits (W8: one group per row)")
    ap.add_argument("--warps", type=int, default=4, help="mma: warps per program")
    ap.add_argument("--m", type=int, default=1, help="rows of x (mma: up to 64)")
    ap.add_argument("--tiles", type=int, default=1, choices=(1, 2, 4), help="mma: K-tiles per step")
    ap.add_argument("--maxnreg", type=int, default=None, help="mma: register budget per thread (ptxas)")
    args = ap.parse_args()
    k, n = SHAPES[args.shape]
    kw = random_kw(k, n, args.bits, 128 if args.bits == 4 else -1)
    x = torch.randn(args.m, k, device="cuda", dtype=torch.float16)
    if args.kernel == "mma":
        mw = triton_mma.from_kernel_weights(kw)
        for _ in range(5):
            triton_mma.gemv(x, mw, num_warps=args.warps, tiles=args.tiles, maxnreg=args.maxnreg)
    else:
        choice = dispatch.choose(args.bits, args.m)
        for _ in range(5):
            dispatch.run(x, kw, None, choice)
        print(choice)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
