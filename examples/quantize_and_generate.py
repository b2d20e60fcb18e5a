"""Quantize a model with RTN W4A16, reload it and generate — the Python API end to end.

    python examples/quantize_and_generate.py MODEL_DIR_OR_GGUF OUT_DIR [--group-size 64]
"""

import argparse

import quantkit
from quantkit import QuantizeConfig, WeightQuantConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args()
    config = QuantizeConfig(method="rtn", weight=WeightQuantConfig(bits=4, group_size=args.group_size))
    result = quantkit.quantize(args.model, config, work_dir=args.out, overwrite=True)
    print("wrote", result.work_dir, f"in {result.report['wall_time_s']:.1f}s")
    pipe = quantkit.pipeline(args.out)
    for r in pipe(["Hi, pls intro yourself", "上海是"], max_new_tokens=48):
        print(f"[{r.finish_reason}, {r.generated_tokens} tokens] {r.text}")


if __name__ == "__main__":
    main()
