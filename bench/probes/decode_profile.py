"""Host-side profile of eager decoding (transformers' generate) of the W4 and fp16 models, per batch size.

    PYTHONPATH=. python bench/probes/decode_profile.py --work /tmp/decode-prof [--layers 4] [--batches 1,8]

Builds the random-weight Llama-2-7B-shape checkpoint of bench/kernels_e2e.py with fewer layers, then for
each batch size times `--new` greedy tokens eagerly and prints cProfile's top functions by own time:
where the host time of an eager decode step goes.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from pathlib import Path

import torch

from bench.kernels_e2e import build_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/quantkit-decode-prof", help="directory for the checkpoint")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers")
    ap.add_argument("--batches", default="1,8", help="batch sizes")
    ap.add_argument("--new", type=int, default=16, help="new tokens per run")
    ap.add_argument("--top", type=int, default=18, help="functions listed per profile")
    args = ap.parse_args()
    import quantkit

    fp16_model, path = build_checkpoint(Path(args.work), args.layers)
    qmodel, _ = quantkit.load(path, device="cuda")
    os.environ["QUANTKIT_KERNEL"] = "triton"
    for batch in (int(b) for b in args.batches.split(",")):
        ids = torch.randint(3, 32000, (batch, 32), device="cuda")
        for name, model in (("fp16", fp16_model), ("w4", qmodel)):
            def run(m=model, ids=ids):
                with torch.inference_mode():
                    return m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                      min_new_tokens=args.new, do_sample=False, pad_token_id=0)
            run()
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            run()
            torch.cuda.synchronize()
            prof.disable()
            ms = (time.perf_counter() - t0) * 1e3 / args.new
            print(f"=== batch {batch} {name}: {ms:.2f} ms per token under the profiler", flush=True)
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
