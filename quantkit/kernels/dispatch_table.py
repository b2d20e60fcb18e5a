"""The kernel choices for a quantized linear, measured on a Hopper GPU: the data `dispatch.choose` picks from.

`TABLE` maps a layer's class, "w{bits} {class}", to rows (largest M, choice) sorted by M. The class is
"block-planar" for that layout, else the layer's width in 16-row tiles per SM (`dispatch.width_class`):
"narrow" ≤ 2 (o, down of Llama-2-7B on 132 SMs), "mid" ≤ 6 (qkv), "wide" above (gate_up), and
"narrow-long-k" for narrow layers with K > 8192 (down), whose Gluon GEMM splits K deeper.

Each row is the configuration timed fastest (or within 3 % of it) on the four Llama-2-7B linears at
its M bound, CUDA-graph medians in µs in the comments (bench/KERNELS_NOTES.md has the runs), and holds
down to the previous bound: block-planar rows by `bench/kernel_speed.py --tune` (least time summed over the
shapes), mma GEMV rows by `bench/lib/kernels_mma.py` (narrow layers want 8 warps splitting K, mid 4,
wide 2; from M = 32 two row tiles per warp; PDL where it measured 4–20 % faster, used only under
QUANTKIT_PDL=1), Gluon GEMM rows by the Gluon probe (bench/KERNELS_NOTES.md). A Gluon row is followed, at the same bound, by the row that
runs where the GEMM may not (`dispatch.choose` skips Gluon rows then).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quantkit.config import UserError


@dataclass(frozen=True)
class Choice:
    """A kernel and its parameters; `programs` is the split-K target in programs per SM (block-planar)."""

    method: str  # "gemv", "gemm" (block-planar), "mma", "gluon" (mma layout) or "dequant+cublas"
    params: dict = field(default_factory=dict)
    programs: float = 4.0


def gemv(block_n: int, blocks: int, num_warps: int, programs: float) -> Choice:
    return Choice("gemv", dict(block_n=block_n, blocks=blocks, num_warps=num_warps, num_stages=1), programs)


def gemm(block_m: int, block_n: int, programs: float) -> Choice:
    return Choice("gemm", dict(block_m=block_m, block_n=block_n, blocks=8, num_warps=4, num_stages=3, swap_ab=True),
                  programs)


def mma(num_warps: int, tiles: int = 1, maxnreg: int | None = None, rows: int = 1, pdl: bool = False) -> Choice:
    """The tensor-core GEMV: warps per program, K-tiles per step, register budget, row tiles per warp;
    `pdl`: programmatic dependent launch with one K-tile prefetched (dropped where the GPU has no PDL)."""
    p = dict(num_warps=num_warps, tiles=tiles, maxnreg=maxnreg)
    if rows > 1:
        p["rows"] = rows
    if pdl:
        p.update(pdl=True, prefetch=1)
    return Choice("mma", p)


def gluon(bm: int, stages: int, rows: int = 64, split: int = 1) -> Choice:
    """The Gluon GEMM: BM rows of x and `rows` weight rows per program, ring slots, K split `split` ways."""
    return Choice("gluon", dict(bm=bm, stages=stages, rows=rows, **({"split": split} if split > 1 else {})))


def fp8_dot(block_n: int, block_m: int, block_k: int = 128, split_k: int = 1, num_warps: int = 4,
            num_stages: int = 4) -> Choice:
    """The FP8 Triton kernel (triton_fp8.dot): weight rows and tokens per program, K step, K split."""
    return Choice("fp8-dot", dict(block_n=block_n, block_m=block_m, block_k=block_k, split_k=split_k,
                                  num_warps=num_warps, num_stages=num_stages))


SCALED_MM = Choice("scaled_mm")  # cuBLAS's FP8 product (torch._scaled_mm)
CUBLAS = Choice("dequant+cublas")  # from M = 64 (W4) or 16 (W8) every block-planar kernel lost to it
ANY = 1 << 30

TABLE: dict[str, list[tuple[int, Choice]]] = {
    "w4 block-planar": [(1, gemv(32, 16, 2, 8)), (2, gemv(32, 16, 2, 4)), (16, gemm(16, 64, 4)),
                        (32, gemm(32, 64, 4)), (ANY, CUBLAS)],
    "w8 block-planar": [(1, gemv(32, 16, 2, 8)), (16, gemm(16, 64, 4)), (ANY, CUBLAS)],
    "w4 narrow": [
        (16, mma(8, 2, 128, pdl=True)),  # o: GEMV 8.3 µs, best GEMM 11.3
        (32, gluon(32, 6, split=2)), (32, mma(8, pdl=True)),  # o 12.2, GEMV 12.8
        (64, gluon(64, 4, split=2)), (64, mma(4, 2, pdl=True)),  # o 12.8, GEMV 15.8
        (128, gluon(64, 4)),  # o 16.4, BM 128 17.5
        (256, gluon(128, 3)),
        (512, gluon(256, 3)),  # o 29.3, BM 128 31.5
        (ANY, CUBLAS)],  # M = 1024: o level with the GEMM
    "w4 narrow-long-k": [
        (16, mma(8, 2, 128, pdl=True)),
        (32, gluon(32, 6, split=4)), (32, mma(8, pdl=True)),  # down 20.3, GEMV 24.5
        (64, gluon(64, 4, split=4)), (64, mma(4, 2, pdl=True)),  # down 23.4, GEMV 38.5
        (256, gluon(128, 3, split=2)),  # down 33.7 (unsplit 45.3) at M = 128, 50.3 (54.2) at 256
        (512, gluon(256, 3)),  # down 78.2, BM 128 83.6
        (ANY, CUBLAS)],  # M = 1024: dequantize + cuBLAS 4 % faster
    "w4 mid": [
        (8, mma(4, 1, 128, pdl=True)), (16, mma(4, pdl=True)),  # qkv: GEMV 14.8, best GEMM 18.9
        (32, mma(4, 1, 168, 2)),  # qkv: GEMV 19.5, GEMM 20.0
        (64, gluon(64, 4)), (64, mma(2, rows=2)),  # qkv 23.7
        (96, gluon(128, 4, rows=128)),
        (128, gluon(128, 3)),  # qkv 30.7
        (256, gluon(128, 2)),  # qkv 52.7, three slots 55.8
        (512, gluon(256, 3)),  # qkv 86.9, BM 128 90.9
        (ANY, CUBLAS)],  # M = 1024: level with the GEMM
    "w4 wide": [
        (16, mma(2)),  # gate_up: PDL slowed its 2-warp programs by 12 %
        (32, gluon(32, 6)), (32, mma(2, 1, 168, 2)),  # gate_up 28.8, GEMV 28.9
        (64, gluon(64, 3)), (64, mma(4, rows=2)),  # gate_up 33.6
        (96, gluon(64, 4, rows=128)),
        (128, gluon(128, 3)),  # gate_up 51.0, BM 64 61.0
        (1024, gluon(256, 3)),  # gate_up 86.4 (BM 128 90.9) at M = 256; 316.4 (dequantize + cuBLAS 347.9) at 1024
        (ANY, CUBLAS)],
    "w8 narrow": [
        (16, mma(8, 2, 128, pdl=True)),
        (32, gluon(32, 6, split=2)), (32, mma(8, pdl=True)),  # o 12.4, GEMV 14.1
        (64, gluon(64, 4, split=2)), (64, mma(4, 2, pdl=True)),  # o 13.0, GEMV 19.8
        (128, gluon(128, 3, split=2)),  # o 18.8, dequantize + cuBLAS 27.4
        (256, gluon(128, 3)),  # o 22.3
        (512, gluon(256, 3)),  # o 30.6, next best 33.7, dequantize + cuBLAS 38.3
        (ANY, CUBLAS)],
    "w8 narrow-long-k": [
        (16, mma(8, 2, 128, pdl=True)),
        (32, gluon(32, 6, split=4)), (32, mma(8, pdl=True)),  # down 20.3, GEMV 27.5
        (64, gluon(64, 4, split=4)), (64, mma(4, 2, pdl=True)),  # down 24.5, GEMV 42.7
        (128, gluon(128, 3, split=2)),  # down 37.0, dequantize + cuBLAS 69.5
        (256, gluon(128, 3)),  # down 56.0
        (512, gluon(256, 3)),  # down 78.3, BM 128 83.7
        (ANY, CUBLAS)],  # M = 1024: down 151.7, GEMM 154.0
    "w8 mid": [
        (8, mma(4, 1, 128, pdl=True)), (16, mma(4, pdl=True)),
        (32, gluon(32, 6)), (32, mma(4, 1, 168, 2)),  # qkv 21.1, GEMV 23.5
        (64, gluon(64, 4)), (64, mma(2, rows=2)),  # qkv 23.4, GEMV 39.3
        (128, gluon(64, 3)),  # qkv 32.5, dequantize + cuBLAS 73.5
        (512, gluon(256, 3)),  # qkv 58.4 (BM 64 61.9) at M = 256, 92.7 (BM 128 98.0) at 512
        (ANY, CUBLAS)],  # M = 1024: qkv 176.2, GEMM 181.1
    "w8 wide": [
        (8, mma(4, 1, 128, pdl=True)), (16, mma(2)),
        (32, gluon(32, 4)), (32, mma(2, 1, 168, 2)),  # gate_up 30.2 (four slots), GEMV 36.0
        (64, gluon(64, 3)), (64, mma(4, rows=2)),  # gate_up 34.0, GEMV 79.3
        (128, gluon(128, 4, rows=128)),  # gate_up 63.7, dequantize + cuBLAS 128.6
        (1024, gluon(256, 3)),  # gate_up 90.4 (128 rows 96.2) at M = 256, 329.7 (dequantize + cuBLAS 349.0) at 1024
        (ANY, CUBLAS)],
    # FP8 W8A8 (e4m3 weights and activations): first rows, not yet timed on a GPU (the Triton swap-AB kernel
    # where a step's few tokens leave cuBLAS's tiles empty, cuBLAS above); bench/fp8_speed.py --tune replaces them.
    "fp8 narrow": [(16, fp8_dot(64, 16, 128, 4)), (64, fp8_dot(64, 64, 128, 2)), (ANY, SCALED_MM)],
    "fp8 narrow-long-k": [(16, fp8_dot(64, 16, 128, 8)), (64, fp8_dot(64, 64, 128, 4)), (ANY, SCALED_MM)],
    "fp8 mid": [(16, fp8_dot(64, 16, 128, 2)), (64, fp8_dot(128, 64, 128, 1)), (ANY, SCALED_MM)],
    "fp8 wide": [(16, fp8_dot(128, 16, 128, 1)), (64, fp8_dot(128, 64, 128, 1)), (ANY, SCALED_MM)],
}


METHODS = {"block-planar": {"gemv", "gemm", "dequant+cublas"}, "mma": {"mma", "gluon", "dequant+cublas"},
           "fp8": {"fp8-dot", "scaled_mm"}}


def choose_fp8(m: int, n: int, k: int, sms: int, table: dict = TABLE, triton_only: bool = False) -> Choice:
    """The table's kernel for M rows on an FP8 layer of N outputs and K inputs (its class by
    dispatch.width_class's rule) on a GPU of `sms` SMs; `triton_only`: the last Triton row at or above M."""
    rows = table[f"fp8 {width_class(n, k, sms)}"]
    if triton_only:
        rows = [(b, c) for b, c in rows if c.method == "fp8-dot"]
    return next((c for bound, c in rows if m <= bound), rows[-1][1])


def width_class(n: int, k: int, sms: int) -> str:
    """A layer's class: its width in 16-row tiles per SM, ≤ 2 narrow, ≤ 6 mid, else wide; narrow with K
    over 8192 is "narrow-long-k"."""
    rows = -(-n // 16)
    if rows <= 2 * sms:
        return "narrow-long-k" if k > 8192 else "narrow"
    return "mid" if rows <= 6 * sms else "wide"


def replaced_rows(table: dict, rows: dict, source: str) -> dict:
    """`table` with the classes `rows` names replaced: {"w4 block-planar": [[largest M, {"method", "params",
    "programs"}], ...], ...}, e.g. what bench/kernel_speed.py --tune measured on another GPU. `source` names
    where the rows came from in the error a malformed row gets."""
    new = dict(table)
    for key, given in rows.items():
        if key not in table:
            raise UserError(f"{source}: unknown class {key!r}; use one of {', '.join(table)}.")
        try:
            new[key] = [(int(b), c if isinstance(c, Choice) else Choice(**c)) for b, c in given]
        except (TypeError, ValueError) as e:
            raise UserError(f"{source}: {key!r} must hold rows [largest M, {{\"method\", \"params\", "
                            f"\"programs\"}}] ({e}).") from None
        bounds, methods = [b for b, _ in new[key]], {c.method for _, c in new[key]}
        allowed = METHODS["block-planar" if key.endswith("block-planar") else "fp8" if key.startswith("fp8") else "mma"]
        if not new[key] or bounds != sorted(bounds) or new[key][-1][1].method == "gluon" or methods - allowed:
            raise UserError(f"{source}: the rows of {key!r} must be sorted by M, use only {sorted(allowed)} "
                            f"and end with a row that is not \"gluon\".")
    return new
