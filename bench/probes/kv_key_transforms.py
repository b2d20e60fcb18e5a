"""Which exact transformation of K (and V) makes per-token int4 codes lose least, on a real model: the
engine's codec applied as fake quantization inside each layer's attention, over a KV16 pool.

    PYTHONPATH=. python bench/probes/kv_key_transforms.py MODEL_DIR [--windows 6] \
        [--variants k=4+v=4,k=4+v=4+had,k=4+v=16+had,k=16+v=4+had,k=4+v=4+hadk,k=4+v=4+center,k=4+v=4+hadk+center]

A variant is `+`-joined options: k=BITS, v=BITS (16: not quantized); had (Hadamard on q, K and V, V's
undone on the output), hadk (on q and K only), rhad=SEED (had with random channel signs); center (keys
minus the midpoints of their calibrated ranges, from MODEL_DIR's KV statistics), vcenter (the same for
values, added back to the output); smooth=A (keys divided, queries multiplied by (range / mean range)^A
per channel). Every option leaves attention exact without quantization. PTB test, 512-token windows.
Findings: BENCHMARKS.md, issue #27's section.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import argparse
import math
import time
import types

import torch

from quantkit.data import evaluation_windows, load_text, tokenize_text
from quantkit.engine.attention import Attention
from quantkit.eval.engine_perplexity import engine_runner, window_logits
from quantkit.eval.loading import load_engine_model
from quantkit.eval.perplexity import window_nll
from quantkit.formats.kv_stats import read_kv_stats
from quantkit.kernels.kv_rotation import KVRotation
from quantkit.kernels.paged_kv import dequantize, pack_int4, quantize_per_token


def fake_quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 16:
        return x
    q, s, z = quantize_per_token(x, bits)
    return dequantize(pack_int4(q) if bits == 4 else q, s, z, bits, x.dtype)


def transformed_forward(variant: str, stats, layer: int, head_dim: int):
    """Attention.forward with the variant's transformations and fake quantization around it."""
    opts = dict(o.split("=") if "=" in o else (o, "1") for o in variant.split("+"))
    kb, vb = int(opts.get("k", 4)), int(opts.get("v", 4))
    kmin, kmax, vmin, vmax = stats.k_min[layer], stats.k_max[layer], stats.v_min[layer], stats.v_max[layer]
    mu = (kmin + kmax) / 2 if "center" in opts else torch.zeros_like(kmin)
    mu_v = (vmin + vmax) / 2 if "vcenter" in opts else torch.zeros_like(vmin)
    rng = ((kmax - kmin) / 2).clamp_min(1e-3)
    s = (rng / rng.mean(-1, keepdim=True)) ** float(opts["smooth"]) if "smooth" in opts else torch.ones_like(kmin)
    rot = KVRotation.hadamard(head_dim, torch.float32, "cpu")
    rq, rk = rot.q, rot.k
    if "rhad" in opts:
        g = torch.Generator().manual_seed(int(opts["rhad"]))
        sign = torch.where(torch.rand(head_dim, generator=g) < 0.5, -1.0, 1.0)
        rq, rk = sign[:, None] * rq, sign[:, None] * rk
    rotate_k = any(o in opts for o in ("had", "hadk", "rhad"))
    rotate_v = "had" in opts or "rhad" in opts

    def forward(self, q, k, v, meta):
        group = q.shape[1] // k.shape[1]
        k, q = (k - mu) / s, q * s.repeat_interleave(group, 0)
        v = v - mu_v
        if rotate_k:
            q, k = q @ rq, k @ rk
        if rotate_v:
            v = v @ rk
        out = Attention.forward(self, q, fake_quant(k, kb), fake_quant(v, vb), meta)
        if rotate_v:
            out = out @ rq.T
        return out + mu_v.repeat_interleave(group, 0)

    return forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--variants", default="k=16+v=16,k=4+v=4,k=4+v=4+had,k=4+v=16+had,k=16+v=4+had,k=4+v=4+hadk,"
                                          "k=4+v=4+center,k=4+v=4+hadk+center")
    ap.add_argument("--data-dir", default="/work/shared/calib_data")
    args = ap.parse_args()
    em = load_engine_model(args.model, "cpu")
    model, stats = em.model, read_kv_stats(args.model)
    text, _ = load_text("ptb", "test", args.data_dir)
    win = evaluation_windows(tokenize_text(em.tokenizer, text), 512, args.windows)
    runner = engine_runner(model, 16, 512)
    for variant in args.variants.split(","):
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn.attn
            attn.forward = types.MethodType(transformed_forward(variant, stats, i, model.head_dim), attn)
        t0 = time.perf_counter()
        nll = sum(window_nll(window_logits(runner, w), w) for w in win)
        print(f"{variant:40s} ppl {math.exp(nll / (len(win) * 511)):.3f}  {time.perf_counter() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
