"""Transient host memory of repacking one layer for the kernels (checkpoint tensors → block-planar → mma).

    PYTHONPATH=. python bench/probes/repack_memory.py [--k 4096 --n 22016]

Each measurement runs in a fresh process: peak resident memory (ru_maxrss) over what the random AWQ
checkpoint tensors already took, for the default row chunks and for whole layers at once (the
repacking before the fifth session). The words are the same either way (checksum printed).
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import argparse
import json
import subprocess
import sys

CHILD = """
import resource, sys, time, torch
from quantkit.kernels import triton_layout, triton_mma
k, n, chunk = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if chunk:
    triton_layout.ROW_CHUNK = chunk
g = torch.Generator().manual_seed(0)
qweight = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, generator=g)
qzeros = torch.randint(-2**31, 2**31 - 1, (k // 128, n // 8), dtype=torch.int32, generator=g)
scales = torch.rand(k // 128, n).half()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.time()
mw = triton_mma.from_kernel_weights(triton_layout.from_awq(qweight, qzeros, scales, 128))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_mb": (peak - base) / 1024, "s": time.time() - t0, "packed_mb": mw.nbytes / 2**20,
                  "checksum": int(mw.qweight.double().sum())}))
""".replace("import resource", "import json, resource")


def measure(k: int, n: int, chunk: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(k), str(n), str(chunk)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4096, help="input features (a multiple of 128)")
    ap.add_argument("--n", type=int, default=22016, help="output features (a multiple of 8)")
    args = ap.parse_args()
    rows = {"chunked (default)": measure(args.k, args.n, 0), "whole layer": measure(args.k, args.n, 1 << 30)}
    for name, r in rows.items():
        print(f"{name:18} peak +{r['peak_mb']:7.0f} MB  {r['s']:5.1f} s  packed {r['packed_mb']:.0f} MB  "
              f"checksum {r['checksum']}")


if __name__ == "__main__":
    main()
