"""Does programmatic dependent launch slow the graphed decode? An interleaved A/B on one machine (H200).

    PYTHONPATH=. python bench/probes/pdl_decode.py --work /tmp/decode [--layers 32] [--reps 5] [--out pdl.json]

Why (bench/KERNELS_NOTES.md items 39–40): PDL made back-to-back GEMVs 4–20 % faster at M ≤ 16, but two
decode runs (run 39, 32 layers; run 40, 8 layers) read the W4 model slower with it at batch 8 (844 vs
927 and 3619 vs 4035 tok/s), so `QUANTKIT_PDL` is off by default. Those were single timings on hosts
whose fp16 figure moved 14 % between calls. Here the same loaded model decodes with QUANTKIT_PDL=0 and
=1 alternately, `--reps` times each, at batch 1 and 8 (the fp16 model interleaved as a control), and
each setting's tokens are compared with the other's: the kernels differ in launch mode only, so they
must agree exactly. A layer keeps its GEMV launch per M once made (`dispatch.gemv_launch`, with the
PDL choice of that moment), so each setting keeps its own set, swapped in at every switch (made in
the untimed first round), and the launches made with PDL are counted after each run. Medians of graphed `quantkit.runtime.decode.generate` (graph captured per call,
as in bench/probes/decode_speed.py, after one warm-up per setting); tokens/s count new tokens only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.kernels_e2e import build_checkpoint
from quantkit.runtime.decode import generate


def swap_launches(model: torch.nn.Module, old: str, new: str, store: dict) -> None:
    """Put away every layer's kept GEMV launches made under setting `old` and bring back those made
    under `new` (none the first time: they are made at the next call with the current QUANTKIT_PDL)."""
    for module in model.modules():
        kw = getattr(module, "_kernel_weights", None)
        if kw is not None:
            store[(id(kw), old)] = kw.__dict__.pop("launches", {})
            kw.__dict__["launches"] = store.get((id(kw), new), {})


def pdl_launches(model: torch.nn.Module) -> int:
    """How many of the model's kept GEMV launches use programmatic dependent launch."""
    return sum(bool(launch and launch.options.get("launch_pdl"))
               for module in model.modules() if getattr(module, "_kernel_weights", None) is not None
               for launch in module._kernel_weights.__dict__.get("launches", {}).values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/quantkit-decode", help="where the random-weight checkpoint is written")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="timed runs per setting and batch")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args()
    import quantkit

    fp16_model, path = build_checkpoint(Path(args.work), args.layers)
    qmodel, _ = quantkit.load(path, device="cuda")
    os.environ["QUANTKIT_KERNEL"] = "triton"
    g = torch.Generator(device="cuda").manual_seed(0)
    result: dict = {"layers": args.layers, "gpu": torch.cuda.get_device_name(), "reps": args.reps}
    for batch in (1, 8):
        ids = torch.randint(3, 32000, (batch, args.prompt), device="cuda", generator=g)
        mask = torch.ones_like(ids)
        settings = (("w4_pdl0", qmodel, "0"), ("w4_pdl1", qmodel, "1"), ("fp16", fp16_model, "0"))
        times: dict = {name: [] for name, _, _ in settings}
        tokens: dict = {}
        with_pdl: dict = {}
        store: dict = {}
        current = "none"  # the PDL setting whose launches qmodel holds
        with torch.inference_mode():
            for rep in range(args.reps + 1):  # rep 0: warm-up (compiles, first captures)
                for name, model, pdl in settings:
                    os.environ["QUANTKIT_PDL"] = pdl
                    if model is qmodel and current != pdl:
                        swap_launches(qmodel, current, pdl, store)
                        current = pdl
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    out = generate(model, ids, mask, args.new, use_graph=True)
                    torch.cuda.synchronize()
                    if rep:
                        times[name].append(time.perf_counter() - t0)
                    tokens[name] = out[:, args.prompt:]
                    with_pdl[name] = pdl_launches(model)
        res = {name: {"tok_per_s": batch * args.new / statistics.median(t), "runs_s": t} for name, t in times.items()}
        res["pdl1_over_pdl0"] = res["w4_pdl1"]["tok_per_s"] / res["w4_pdl0"]["tok_per_s"]
        res["pdl_tokens_equal"] = bool(torch.equal(tokens["w4_pdl0"], tokens["w4_pdl1"]))
        res["pdl_launches"] = {"w4_pdl0": with_pdl["w4_pdl0"], "w4_pdl1": with_pdl["w4_pdl1"]}
        result[f"batch{batch}"] = res
        print(f"batch {batch}: " + "  ".join(f"{n} {res[n]['tok_per_s']:.1f} tok/s" for n in times)
              + f"  PDL on / off {res['pdl1_over_pdl0']:.3f}  tokens equal {res['pdl_tokens_equal']}"
              + f"  PDL launches {res['pdl_launches']}", flush=True)
    os.environ["QUANTKIT_PDL"] = "0"
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
