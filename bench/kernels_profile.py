"""One kernel launch to profile with Nsight Compute: the tuned M = 1 W4 GEMV on the qkv shape.

    ncu --kernel-name regex:gemv_kernel --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \\
        --section LaunchStats --section MemoryWorkloadAnalysis python bench/kernels_profile.py

(PYTHONPATH=. from the repository root.) Launches the dispatch table's M = 1 choice five times.
"""

from __future__ import annotations

import torch

from bench.kernel_candidates import SHAPES, random_kw
from quantkit.kernels import dispatch


def main() -> None:
    k, n = SHAPES["qkv"]
    kw = random_kw(k, n, 4, 128)
    x = torch.randn(1, k, device="cuda", dtype=torch.float16)
    choice = dispatch.choose(4, 1)
    for _ in range(5):
        dispatch.run(x, kw, None, choice)
    torch.cuda.synchronize()
    print(choice)


if __name__ == "__main__":
    main()
