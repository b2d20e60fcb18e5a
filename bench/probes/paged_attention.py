"""Time the paged decode-attention kernel (quantkit/kernels/triton_paged.py) on the GPU, one layer.

    PYTHONPATH=. python bench/probes/paged_attention.py [--shape llama3-8b] [--sweep]
    PYTHONPATH=. python bench/probes/paged_attention.py --variants [--sweep] [--out DIR]

For each batch size and context length (every sequence at that length) and each KV format
(fp16, int8, int4), the CUDA-graph median time of one call (write excluded), the KV bytes it reads
per µs (GB/s) and, for fp16, torch's SDPA over the same K/V held contiguously (flash-decoding's
baseline: no paging, no dequantization). The block table is as wide as --max-model-len, as the
engine's graphs see it. --sweep also times tile sizes, warps and partition counts other than the
launcher's defaults, to choose them. --variants times the two decode kernels ("dot": decode_kernel,
"rows": triton_paged_rows) against each other at Llama-2-7B b1 and b32 × 4,096 and Llama-3-8B b32 × 4,096,
with their outputs' max abs difference, and writes paged_variants.json to --out; with --sweep also the
rows kernel's tile sizes and warps.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import argparse
import itertools
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from quantkit.kernels import triton_paged
from quantkit.kernels.paged_kv import PagedKV, write_kv

SHAPES = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}
BLOCK = 16


def graph_time(fn, replays: int = 50) -> float:
    """Median µs of one replay of a CUDA graph of `fn`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def setup(shape: str, batch: int, ctx: int, bits: int, max_model_len: int):
    heads, kv_heads, d = SHAPES[shape]
    blocks_per_seq = math.ceil(ctx / BLOCK)
    width = math.ceil(max_model_len / BLOCK)
    cache = PagedKV.allocate(batch * blocks_per_seq + 1, BLOCK, kv_heads, d, bits, torch.float16, "cuda")
    perm = torch.randperm(batch * blocks_per_seq, device="cuda").int()
    tables = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
    tables[:, :blocks_per_seq] = perm.view(batch, blocks_per_seq)
    k = torch.randn(batch * blocks_per_seq * BLOCK, kv_heads, d, device="cuda").half()
    slots = torch.arange(k.shape[0], device="cuda")
    write_kv(cache, k, torch.randn_like(k), slots)
    q = torch.randn(batch, heads, d, device="cuda").half()
    ctx_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return q, cache, tables, ctx_lens, k


CASES = {"7b-b32": ("llama2-7b", 32, 4096), "7b-b1": ("llama2-7b", 1, 4096), "8b-b32": ("llama3-8b", 32, 4096)}


def compare_variants(out: Path | None, sweep: bool, cases=tuple(CASES.values()), bits_list=(16, 8, 4)) -> None:
    """Both decode kernels on the issue's shapes; µs per layer, effective TB/s, max |dot − rows|."""
    print(torch.cuda.get_device_name())
    print(f"{'shape':>10} {'batch':>5} {'ctx':>5} {'kv':>3} {'kernel':>19} {'µs':>8} {'TB/s':>6} {'max|Δ|':>8}")
    rows = []
    # the sweep: tiles, warps and partitions of the rows kernel for MHA (32 tokens or 8 warps were never the
    # fastest; GQA 4 is 3× slower than dot in every tile, so it gets the default only)
    tiles = list(itertools.product((64, 128), (2, 4), (None, 2, 4, 8)))
    for shape, batch, ctx in cases:
        heads, kv_heads, d = SHAPES[shape]
        for bits in bits_list:
            q, cache, tables, lens, k = setup(shape, batch, ctx, bits, 8192)
            read = batch * ctx * PagedKV.bytes_per_token(kv_heads, d, bits, torch.float16)
            call = lambda **cfg: triton_paged.paged_decode_attention(q, cache, tables, lens, d**-0.5, **cfg)  # noqa: E731
            dot = call(kernel="dot")
            configs = [dict(kernel="dot"), dict(kernel="rows")]
            if sweep and kv_heads == heads:
                configs += [dict(kernel="rows", block_n=n, num_warps=w, partitions=p) for n, w, p in tiles]
                # the dot kernel with more partitions than the launcher's rule gives (1 at b32 × 32 kv heads)
                configs += [dict(kernel="dot", block_n=64, num_warps=4, partitions=p) for p in (2, 4, 8)]
            for cfg in configs:
                try:
                    diff = (call(**cfg).float() - dot.float()).abs().max().item()
                    us = graph_time(lambda: call(**cfg))
                except Exception as e:  # e.g. a tile that does not fit: report and go on
                    print(f"{shape:>10} {batch:>5} {ctx:>5} {bits:>3} {str(cfg):>19} failed: {type(e).__name__}: {e}")
                    continue
                name = cfg["kernel"] + ("" if len(cfg) == 1 else
                                        f" n{cfg['block_n']} w{cfg['num_warps']} p{cfg['partitions'] or '-'}")
                print(f"{shape:>10} {batch:>5} {ctx:>5} {bits:>3} {name:>19} {us:8.1f} {read / us / 1e6:6.2f} {diff:8.1e}")
                rows.append(dict(shape=shape, batch=batch, ctx=ctx, bits=bits, **cfg, us=us, tb_s=read / us / 1e6,
                                 max_abs_diff_vs_dot=diff))
            del q, cache, tables, lens, k, dot
            torch.cuda.empty_cache()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "paged_variants.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                            indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--contexts", default="128,1024,4096,8192")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--bits", default="16,8,4", help="KV formats to time (comma-separated)")
    ap.add_argument("--variants", action="store_true", help="the dot and rows decode kernels side by side")
    ap.add_argument("--out", type=Path, default=None, help="directory for paged_variants.json (--variants)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"--variants: comma list of {', '.join(CASES)}")
    args = ap.parse_args()
    if args.variants:
        return compare_variants(args.out, args.sweep, [CASES[c] for c in args.cases.split(",")],
                                [int(b) for b in args.bits.split(",")])
    heads, kv_heads, d = SHAPES[args.shape]
    print(f"{args.shape}: {heads} heads, {kv_heads} kv heads, head_dim {d}; {torch.cuda.get_device_name()}")
    print(f"{'batch':>5} {'ctx':>6} {'kv':>4} {'config':>26} {'µs':>9} {'GB/s':>7}")
    for batch, ctx in itertools.product(map(int, args.batches.split(",")), map(int, args.contexts.split(","))):
        for bits in map(int, args.bits.split(",")):
            q, cache, tables, lens, k = setup(args.shape, batch, ctx, bits, args.max_model_len)
            read = batch * ctx * PagedKV.bytes_per_token(kv_heads, d, bits, torch.float16)
            configs = [dict()]
            if args.sweep:
                configs += [dict(block_n=n, num_warps=w, partitions=p) for n, w, p in
                            itertools.product((32, 64, 128), (2, 4, 8), (None, 1, 8, 32))]
            for cfg in configs:
                try:
                    us = graph_time(lambda: triton_paged.paged_decode_attention(q, cache, tables, lens, d**-0.5, **cfg))
                except Exception as e:  # e.g. a tile that does not fit: report and go on
                    print(f"{batch:>5} {ctx:>6} {bits:>4} {str(cfg):>26} failed: {type(e).__name__}")
                    continue
                name = "default" if not cfg else f"n{cfg['block_n']} w{cfg['num_warps']} p{cfg['partitions']}"
                print(f"{batch:>5} {ctx:>6} {bits:>4} {name:>26} {us:9.1f} {read / us / 1e3:7.0f}")
            if bits == 16:
                kk = k[: batch * ctx].view(batch, ctx, kv_heads, d).transpose(1, 2).contiguous()
                vv = torch.randn_like(kk)
                q4 = q[:, :, None, :]
                us = graph_time(lambda: F.scaled_dot_product_attention(q4, kk, vv, scale=d**-0.5, enable_gqa=True))
                print(f"{batch:>5} {ctx:>6} {'sdpa':>4} {'contiguous fp16':>26} {us:9.1f} {read / us / 1e3:7.0f}")
            del q, cache, tables, lens, k
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
