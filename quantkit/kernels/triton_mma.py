"""Tensor-core GEMV for M ≤ 64: the weight tile is the A operand of `mma.sync` m16n8k16, x the B operand.

At M = 1 a CUDA-core GEMV spends ≥ 2 instructions per weight (extract, convert, multiply-add) and in
practice about 4. Here one warp owns 16 output rows and walks K in tiles of 128 inputs; per tile and
thread it loads 4 words (W4) or 8 words (W8) of rows g and g + 8 (g = lane / 4) with 16-byte loads,
turns each word into fp16 pairs with one `lop3` per pair (W4: nibbles under the exponent of 1024, so
the pair reads 1024 + q; the odd nibbles are read in place as 1024 + 16·q) or one `prmt` per pair
(W8), takes the offset and the zero point off with one `fma` per pair — (1024 + q)·1 − (1024 + z),
odd nibbles (1024 + 16·q)·1/16 − (64 + z), exact in fp16 (bf16: 128 + q, z < 16) — and hands the
pairs to `mma.sync` with fp32 accumulation. The scale multiplies once per tile (a tile lies in one
group). ≈ 2.1 SASS instructions per weight at M = 1 (the CUDA-core GEMV of triton_gemv needs ≈ 3.9).

The B operand's 8 columns carry 8 rows of x; 1, 2, 4 or 8 column tiles (M ≤ 8, 16, 32, 64) share
each unpacked weight tile, so M ≤ 8 costs what M = 1 does. x is loaded per 32-input chunk; rows of
x past M are not loaded. A warp may take 1, 2 or 4 row tiles (16 rows each) at once: their weights
then share each x chunk, which cuts the x traffic (at M = 16–64 larger than the weights') by that
factor.

Layout ("mma layout", made once at load time by `pack_mma`): within a row, K is cut into tiles of
128 inputs; tile T of row n holds 16 words (W4), word 4·t + c covering inputs 128·T + 32·c + 8·t +
(0…7) with the nibble at bits 4·p holding input offset W4_ORDER[p] (0, 4, 2, 6, 1, 5, 3, 7), so that
thread t's pairs meet 4-input runs of x that are contiguous in memory (four 16-byte x loads per
tile). W8: 32 words per tile, word 8·t + 2·c + h covering 128·T + 32·c + 8·t + 4·h + (0…3) in byte
order. These row words are then stored as one contiguous block per (16-row tile, K tile): [row
half, chunk v, lane 4·g + t, 4 words], where row half h and lane hold row 16·r + 8·h + g and chunk v
the thread's words 4v … 4v + 3. One warp-wide 16-byte load reads 512 contiguous bytes, and a program
streams its 16 rows front to back (10 % faster at M = 1 than row-major words). qweight is
int32 [row tiles, K tiles · 64 · words per thread]; rows past N (up to a multiple of 64) and K past
the last tile are zero.

The inner loop is inline PTX (`tl.inline_asm_elementwise`, one element per thread), so this kernel
runs on NVIDIA GPUs only (sm_80 and later; PDL needs sm_90), not under a plain TRITON_INTERPRET; the
CPU tests run the whole kernel under the interpreter with its inline PTX executed by a small PTX
interpreter (tests/support/quantkit_testing/ptx_interp.py), and tests/support/quantkit_testing/kernel_oracles.py reproduces the arithmetic in torch. Figures and
the variants tried: BENCHMARKS.md ("Kernels") and bench/KERNELS_NOTES.md.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from quantkit.kernels.launch import KeptKernel, compiled_form, hooks_set, run_compiled
from quantkit.kernels.triton_gemm import dequant_values, zero_bias_scale
from quantkit.kernels.triton_layout import KernelWeights, PackedWeights, by_rows, unpack_block_planar
from quantkit.kernels.triton_splitk import clamp_split, counters, store_points, workspace

TILE_K = 128
ROW_TILES_MAX = 4  # most 16-row tiles per warp (`gemv(rows=…)`); qweight's row tiles are a multiple
# Step h of a word's two mma steps takes its two fp16 pairs from nibbles (p, p + 4), p = PAIR_NIBBLE[h][i]:
# the pair's inputs are offsets 4·h + 2·i and 4·h + 2·i + 1 of the word's 8. Odd p sit 4 bits up, so
# with fp16 the step with odd p reads them in place as 1024 + 16·q (one lop3, no shift).
PAIR_NIBBLE = ((0, 2), (1, 3))
W4_ORDER = tuple(  # input offset held by nibble p of a word
    next(4 * h + 2 * i + (p >= 4) for h in range(2) for i in range(2) if PAIR_NIBBLE[h][i] == p % 4)
    for p in range(8))


class MmaWeights(PackedWeights):
    """One layer's weights in the mma layout (module docstring): qweight int32 [row tiles, blocks];
    scales and zeros as in the block-planar layout."""


def supports(bits: int, group_size: int, in_features: int, groups: int, dtype: torch.dtype) -> bool:
    """Whether the mma kernel takes this layer: groups of whole 128-input tiles (or one group per row),
    fp16 activations, or bf16 with 4-bit weights (bf16 holds 128 + q exactly only for q < 128)."""
    whole = groups == 1 or group_size % TILE_K == 0
    return whole and in_features % 8 == 0 and (dtype == torch.float16 or (dtype == torch.bfloat16 and bits == 4))


def _row_words(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers q [N, K] → int32 [N, tiles · 4 · wpt]: each row's words in tile order (module docstring)."""
    n, k = q.shape
    kp = -(-k // TILE_K) * TILE_K
    v = torch.zeros(n, kp, dtype=torch.int64, device=q.device)
    v[:, :k] = q.to(torch.int64)
    # [N, tile, c, t, 8 inputs]: inputs 128·T + 32·c + 8·t + o; words are ordered (t, c).
    v = v.reshape(n, kp // TILE_K, 4, 4, 8).transpose(2, 3)
    if bits == 4:
        order = torch.tensor(W4_ORDER, device=q.device)
        shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
        words = (v[..., order] << shifts).sum(-1)  # [N, T, t, c]
    else:
        v = v.reshape(n, kp // TILE_K, 4, 4, 2, 4)  # (t, c, h, byte)
        shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=q.device)
        words = (v << shifts).sum(-1)  # [N, T, t, c, h]
    words = words - (words >= 2**31).to(torch.int64) * 2**32
    return words.to(torch.int32).reshape(n, -1)


def _blocks(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Row words [N, KW] → blocks [row tiles, KW · 16] (module docstring); rows past N are zero, and
    the row tiles a multiple of ROW_TILES_MAX so that a program of up to that many row tiles never
    reads past the buffer."""
    wpt = 4 if bits == 4 else 8
    rows, kw = -(-words.shape[0] // (16 * ROW_TILES_MAX)) * 16 * ROW_TILES_MAX, words.shape[1]
    w = torch.zeros(rows, kw, dtype=torch.int32, device=words.device)
    w[:words.shape[0]] = words
    kt = kw // (4 * wpt)
    w = w.reshape(rows // 16, 2, 8, kt, 4, wpt // 4, 4).permute(0, 3, 1, 5, 2, 4, 6)  # [r, T, half, v, g, t, i]
    return w.reshape(rows // 16, kt * 64 * wpt).contiguous()


def pack_mma(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers q [N, K] in 0..2^b−1 → int32 [row tiles, words] in the mma layout."""
    return _blocks(_row_words(q, bits), bits)


def from_kernel_weights(kw: KernelWeights) -> MmaWeights:
    """The mma layout of a layer already in the block-planar kernel layout (same scales and zeros)."""
    def rows(r0: int, r1: int) -> torch.Tensor:  # ROW_CHUNK is a multiple of 64: whole groups of row tiles
        return pack_mma(unpack_block_planar(kw.qweight[r0:r1], kw.bits, kw.in_features), kw.bits)

    return MmaWeights(by_rows(kw.out_features, rows), kw.scales, kw.zeros, kw.bits, kw.group_size,
                      kw.in_features, kw.out_features)


def _asm(bits: int, col_tiles: int, bf16: bool, even_k: bool, tiles: int, rows: int = 1) -> tuple[str, str]:
    """PTX for `tiles` K-tiles of one warp over `rows` 16-row tiles with up to 8 column tiles (M ≤ 64),
    and its constraints.

    The zero point is taken off the weights before the mma (one `fma` per fp16 pair, exact), so each
    step costs one mma per column tile and row tile; an earlier form subtracted it with a second mma
    per step and summed the odd nibbles in a second accumulator (slower; see bench/KERNELS_NOTES.md).
    x is loaded per 32-input chunk and shared by the `rows` row tiles (x is re-read once per 16·rows
    weight rows). With several tiles or rows, all their word loads come first; ptxas keeps them in
    flight together only under a register budget (`maxnreg`).
    Operands: outputs acc[4·col_tiles·rows] (row tile r, column tile c at 4·(col_tiles·r + c));
    inputs per K-tile: word address of row g of row tile 0, x address of x row g (clamped to M − 1),
    inputs left, then per row tile the raw scales and zeros of rows g and g + 8; then the byte
    distance between two row tiles' blocks, the byte distance of 8 x rows and M − g (column tile c
    reads x rows 8·c + g while they are < M, zeros past them); then acc[4·col_tiles·rows].
    """
    wpt = 4 if bits == 4 else 8
    n_acc = 4 * col_tiles * rows
    cons = ["=f"] * n_acc
    ops = []
    for _ in range(tiles):
        op = {}
        for name, c in [("wa", "l"), ("xa", "l"), ("kl", "r")]:
            op[name] = f"${len(cons)}"
            cons.append(c)
        for r in range(rows):
            for name, c in [("s", "h"), ("s8", "h"), ("z", "r"), ("z8", "r")]:
                op[f"{name}{r}"] = f"${len(cons)}"
                cons.append(c)
        ops.append(op)
    rs, xs, mg = f"${len(cons)}", f"${len(cons) + 1}", f"${len(cons) + 2}"
    cons += ["l", "l", "r"]
    acc_in = [f"${len(cons) + i}" for i in range(n_acc)]
    cons += ["f"] * n_acc
    x16 = bits == 4 and not bf16
    magic = "0x43004300" if bf16 else "0x64006400"
    ab = "bf16" if bf16 else "f16"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32"
    one = "0x3F803F80" if bf16 else "0x3C003C00"
    per_tile = 2 * wpt * rows  # word registers of one K-tile
    zregs = [f"{z}_{u}_{r}" for z in ("zg", "zg8", "zh", "zh8") for u in range(tiles) for r in range(rows)]
    L = ["{",
         ".reg .pred px, pr;",
         f".reg .b32 w<{per_tile * tiles}>, x<{16 * col_tiles * tiles}>, a<4>, sh, kt, one, sixteenth, "
         + ", ".join(zregs) + ";",
         f".reg .f32 d<{n_acc * tiles}>, sg, sg8;",
         f".reg .b64 xc<{col_tiles}>{', ra' if rows > 1 else ''};",
         f"mov.b32 one, {one};", "mov.b32 sixteenth, 0x2C002C00;"]
    for u, op in enumerate(ops):
        for r in range(rows):
            wb = per_tile * u + 2 * wpt * r
            addr = op["wa"]
            if r:
                L.append(f"mad.lo.s64 ra, {rs}, {r}, {op['wa']};")
                addr = "ra"
            for v in range(wpt // 4):
                for row in (0, wpt):  # rows g and g + 8: the second row half starts wpt·128 bytes on
                    regs = ", ".join(f"w{wb + row + 4 * v + i}" for i in range(4))
                    L.append(f"ld.global.L1::no_allocate.v4.u32 {{{regs}}}, [{addr}+{512 * v + 128 * row}];")
    for u, op in enumerate(ops):
        for r in range(rows):
            # −(1024 + z) (bf16: −(128 + z)) per row, twice per word; odd nibbles: −(64 + z), z·16 in the mantissa.
            for dst, src, shift, base in (("zg", op[f"z{r}"], 0, "0xE400"), ("zg8", op[f"z8{r}"], 0, "0xE400"),
                                          ("zh", op[f"z{r}"], 4, "0xD400"), ("zh8", op[f"z8{r}"], 4, "0xD400")):
                if shift and not x16:
                    continue
                if shift:
                    L.append(f"shl.b32 sh, {src}, {shift};")
                    src = "sh"
                L.append(f"or.b32 {dst}_{u}_{r}, {src}, {'0xC300' if bf16 else base};")
                L.append(f"prmt.b32 {dst}_{u}_{r}, {dst}_{u}_{r}, {dst}_{u}_{r}, 0x1010;")
    L += [f"mov.f32 d{i}, 0f00000000;" for i in range(n_acc * tiles)]
    for c in range(4):
        for u, op in enumerate(ops):
            for nt in range(col_tiles):
                xb = 16 * (col_tiles * u + nt) + 4 * c
                xr = ", ".join(f"x{xb + i}" for i in range(4))
                conds = []
                if nt:
                    conds.append(f"setp.gt.s32 pr, {mg}, {8 * nt};")
                if not even_k:
                    conds.append(f"sub.s32 kt, {op['kl']}, {32 * c};")
                    conds.append("setp.gt.s32 px, kt, 0;")
                if nt and not even_k:
                    conds.append("and.pred px, px, pr;")
                elif nt:
                    conds.append("mov.pred px, pr;")
                addr = op["xa"]
                if nt:  # x rows 8·nt + g, per chunk (hoisted out of the c loop, ptxas spilled more at 8 column tiles)
                    L.append(f"mul.lo.s64 xc{nt}, {xs}, {nt};")
                    L.append(f"add.s64 xc{nt}, xc{nt}, {op['xa']};")
                    addr = f"xc{nt}"
                if conds:
                    L += conds
                    L += [f"mov.b32 x{xb + i}, 0;" for i in range(4)]
                    L.append(f"@px ld.global.v4.u32 {{{xr}}}, [{addr}+{64 * c}];")
                else:
                    L.append(f"ld.global.v4.u32 {{{xr}}}, [{addr}+{64 * c}];")
        for h in range(2):
            for u in range(tiles):
                for r in range(rows):
                    wb = per_tile * u + 2 * wpt * r
                    zs = f"_{u}_{r}"
                    if bits == 4:
                        for which, word in ((0, f"w{wb + c}"), (1, f"w{wb + wpt + c}")):
                            z = ("zg" if which == 0 else "zg8") + zs
                            for i, p in enumerate(PAIR_NIBBLE[h]):
                                odd = x16 and p % 2
                                shift = 4 * (p - 1) if odd else 4 * p
                                src = word
                                if shift:
                                    L.append(f"shr.b32 sh, {word}, {shift};")
                                    src = "sh"
                                mask = "0x00F000F0" if odd else "0x000F000F"
                                reg = f"a{which + 2 * i}"
                                L.append(f"lop3.b32 {reg}, {src}, {mask}, {magic}, 0xEA;")
                                zz = z.replace("zg", "zh") if odd else z
                                L.append(f"fma.rn.{ab}x2 {reg}, {reg}, {'sixteenth' if odd else 'one'}, {zz};")
                    else:
                        for which, word in ((0, f"w{wb + 2 * c + h}"), (1, f"w{wb + wpt + 2 * c + h}")):
                            z = ("zg" if which == 0 else "zg8") + zs
                            L.append(f"prmt.b32 a{which}, {word}, 0x64646464, 0x4140;")
                            L.append(f"prmt.b32 a{which + 2}, {word}, 0x64646464, 0x4342;")
                            L.append(f"fma.rn.f16x2 a{which}, a{which}, one, {z};")
                            L.append(f"fma.rn.f16x2 a{which + 2}, a{which + 2}, one, {z};")
                    for nt in range(col_tiles):
                        xb = 16 * (col_tiles * u + nt) + 4 * c + 2 * h
                        d0 = n_acc * u + 4 * (col_tiles * r + nt)
                        dd = ", ".join(f"d{d0 + i}" for i in range(4))
                        L.append(f"{mma} {{{dd}}}, {{a0, a1, a2, a3}}, {{x{xb}, x{xb + 1}}}, {{{dd}}};")
    prev = acc_in
    for u, op in enumerate(ops):  # $i = scale of the row · tile u's sum + the sum so far
        for r in range(rows):
            L += [f"cvt.f32.f16 sg, {op[f's{r}']};", f"cvt.f32.f16 sg8, {op[f's8{r}']};"]
            for j in range(4 * col_tiles):
                i = 4 * col_tiles * r + j
                L.append(f"fma.rn.f32 ${i}, {'sg' if i % 4 < 2 else 'sg8'}, d{n_acc * u + i}, {prev[i]};")
        prev = [f"${i}" for i in range(n_acc)]
    L.append("}")
    return "\n".join(L), ",".join(cons)


@functools.cache
def asm_for(bits: int, col_tiles: int, bf16: bool, even_k: bool, tiles: int, rows: int = 1) -> tuple[str, str]:
    """The PTX and constraints of one configuration (a pure function of it, made once)."""
    return _asm(bits, col_tiles, bf16, even_k, tiles, rows)


@triton.jit
def _tile(tile, hi, w_row, x_row, t, K, TILE_BYTES: tl.constexpr):
    """One tile's operands for each thread: word address of row g, x address of x row g, inputs left.
    A tile past `hi` is clamped to valid memory (its scales are 0, see `_tile_scales`)."""
    tc = tl.minimum(tile, hi - 1).to(tl.int64)
    kl = (K - tc * 128 - t * 8).to(tl.int32)
    return w_row + tc * TILE_BYTES, x_row + tc * 256, kl


@triton.jit
def _tile_scales(tile, hi, s_row, z_row, row_ok, row8_ok, G, group_size: tl.constexpr):
    """Raw scales and zeros of rows g and g + 8 of one row tile for one K-tile (scale 0 past `hi`)."""
    ok = tile < hi
    tc = tl.minimum(tile, hi - 1).to(tl.int64)
    gi = tl.minimum(tc * 128 // group_size, G - 1).to(tl.int32)
    s = tl.load(s_row + gi, mask=ok & row_ok, other=0.0)
    s8 = tl.load(s_row + 8 * G + gi, mask=ok & row8_ok, other=0.0)
    z = tl.load(z_row + gi, mask=ok & row_ok, other=0).to(tl.int32)
    z8 = tl.load(z_row + 8 * G + gi, mask=ok & row8_ok, other=0).to(tl.int32)
    return s, s8, z, z8


@triton.jit
def _tile_ops(tile, hi, w_row, x_row, s_row, z_row, row, N, t, K, G, group_size: tl.constexpr,
              TILE_BYTES: tl.constexpr, ROWS: tl.constexpr):
    """The asm operands of one K-tile: `_tile`, then `_tile_scales` of each of the ROWS row tiles."""
    ops = _tile(tile, hi, w_row, x_row, t, K, TILE_BYTES)
    for r in tl.static_range(ROWS):
        ops = ops + _tile_scales(tile, hi, s_row + 16 * r * G, z_row + 16 * r * G, row + 16 * r < N,
                                 row + 16 * r + 8 < N, G, group_size)
    return ops


@triton.jit
def mma_gemv_kernel(
    x_addr, w_addr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, KW, G, RT, SPLIT_K, stride_xm, stride_om, group_size: tl.constexpr,
    ASM: tl.constexpr, CONS: tl.constexpr, BITS: tl.constexpr, COLS: tl.constexpr, NW: tl.constexpr,
    TILES: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr = 1, WR: tl.constexpr = 1,
    SPLIT: tl.constexpr = False, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
):
    """Program (i, j) takes 16·ROWS·WR output rows and the j-th of SPLIT_K slices of the K tiles. Its NW
    warps form WR groups along the rows (ROWS row tiles each) by NW / WR along K: warp w = WR·a + b takes
    row tiles b·ROWS … of the program and K tiles a, a + NW / WR, … of the slice, TILES of them per asm
    call. The warps of a row group sum at the end, and with SPLIT the slices through the split-K
    workspace (triton_splitk). The warps of a program read the same x tiles at about the same time, so
    with WR > 1 their x loads meet in L1.

    With PDL (launched with programmatic dependent launch) the program lets the next kernel launch at
    once, asks L2 for the words of its warps' first PREFETCH K-tiles, and only then waits for the
    previous kernel to finish: weights never depend on it, x and the output may. So a kernel's
    start-up overlaps the previous kernel's tail."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    T: tl.constexpr = 32 * NW
    WK: tl.constexpr = NW // WR
    WPT: tl.constexpr = 4 if BITS == 4 else 8
    e = tl.arange(0, T)
    warp = e // 32
    lane = e % 32
    g = lane // 4
    t = lane % 4
    first = pid_n * WR * ROWS + (warp % WR) * ROWS  # the warp's first row tile
    row = first * 16 + g
    # The program's blocks (module docstring): thread (g, t) reads bytes 16·lane of each 512-byte chunk;
    # row tile r's blocks start r·KW words on. Rows past N are zero padding (a warp wholly past the
    # padded row tiles RT reads the last ones instead; its rows are past N, so it stores nothing); x
    # rows past M are clamped (column tile 0) or not loaded.
    w_row = w_addr + tl.minimum(first, RT - ROWS).to(tl.int64) * KW * 4 + lane * 16
    TILE_BYTES: tl.constexpr = WPT * 256
    x_row = x_addr + tl.minimum(g, M - 1).to(tl.int64) * stride_xm * 2 + t * 16
    s_row = s_ptr + row * G
    z_row = z_ptr + row * G
    n_tiles = tl.cdiv(K, 128)
    per = tl.cdiv(n_tiles, SPLIT_K)
    lo = pid_k * per
    hi = tl.minimum(lo + per, n_tiles)
    zero = tl.zeros([T], dtype=tl.float32)
    acc = (zero,) * (4 * COLS * ROWS)
    rows8 = stride_xm.to(tl.int64) * 16 + e * 0  # bytes of 8 x rows, per thread
    tile_rows = KW.to(tl.int64) * 4 + e * 0  # bytes between two row tiles' blocks
    m_left = M - g
    tile = lo + warp // WR
    if PDL:
        _ptx_effect("griddepcontrol.launch_dependents;", e)
        for u in tl.static_range(PREFETCH):
            tc = tl.minimum(tile + u * WK, hi - 1).to(tl.int64)
            for r in tl.static_range(ROWS):
                for half in tl.static_range(WPT // 2):  # 512-byte runs: rows g, g + 8 (W8: two chunks each)
                    _prefetch_l2(w_row + tc * TILE_BYTES + r * tile_rows + half * 512)
        _ptx_effect("griddepcontrol.wait;", e)
    for _ in range(0, tl.cdiv(per, WK * TILES)):
        ops = _tile_ops(tile, hi, w_row, x_row, s_row, z_row, row, N, t, K, G, group_size, TILE_BYTES, ROWS)
        for u in tl.static_range(1, TILES):
            ops = ops + _tile_ops(tile + u * WK, hi, w_row, x_row, s_row, z_row, row, N, t, K, G, group_size,
                                  TILE_BYTES, ROWS)
        acc = tl.inline_asm_elementwise(ASM, CONS, ops + (tile_rows, rows8, m_left) + acc,
                                        dtype=(tl.float32,) * (4 * COLS * ROWS), is_pure=True, pack=1)
        tile += WK * TILES
    # Lane (g, t) of row group b holds rows g and g + 8 of each of its row tiles for x rows 2t and 2t + 1
    # of each column tile; after the sum over K groups, element j of a [WR·32] vector is lane j % 32 of
    # row group j // 32.
    j = tl.arange(0, WR * 32)
    m0 = (j % 4) * 2
    offs_m = _pairs(m0, m0 + 1, m0, m0 + 1, WR * 32)
    for r in tl.static_range(ROWS):
        n0 = (pid_n * WR * ROWS + (j // 32) * ROWS + r) * 16 + (j % 32) // 4
        offs_n = _pairs(n0, n0, n0 + 8, n0 + 8, WR * 32)
        for nt in tl.static_range(COLS):
            vals = _pairs(_warp_sum(acc[4 * (COLS * r + nt)], WK, WR), _warp_sum(acc[4 * (COLS * r + nt) + 1], WK, WR),
                          _warp_sum(acc[4 * (COLS * r + nt) + 2], WK, WR),
                          _warp_sum(acc[4 * (COLS * r + nt) + 3], WK, WR), WR * 32)
            store_points(vals, offs_m + 8 * nt, offs_n, M, N, out_ptr, stride_om, bias_ptr, ws_ptr, cnt_ptr,
                         (pid_n * ROWS + r) * COLS + nt, pid_k, SPLIT_K, SPLIT, HAS_BIAS)


@triton.jit
def _prefetch_l2(addr):
    """Ask L2 for the line holding each thread's address (no register result)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [addr], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _ptx_effect(INSTR: tl.constexpr, like):
    """One PTX instruction without operands (griddepcontrol), run by every thread (`like` gives the shape)."""
    tl.inline_asm_elementwise(INSTR + "\nmov.u32 $0, 0;", "=r,r", [like * 0], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _warp_sum(a, WK: tl.constexpr, WR: tl.constexpr):
    """[NW·32] per thread → [WR·32]: the sum over the WK warps along K of each row group's lanes."""
    return tl.sum(tl.reshape(a, [WK, WR * 32]), axis=0)


@triton.jit
def _pairs(p, q, r, s, L: tl.constexpr):
    """Four [L] vectors as one [4·L] vector."""
    return tl.reshape(tl.join(tl.join(p, q), tl.join(r, s)), [4 * L])


class GemvLaunch:
    """The mma GEMV of one layer for a fixed M and activation dtype, set up once: every argument but x
    and the output is worked out here (column tiles, split-K clamp, workspace, counters, the PTX).

    The first call launches through Triton's JIT front end, which compiles or finds the kernel. Later
    calls hand the arguments straight to that compiled kernel as long as nothing Triton specializes
    on has changed (16-byte alignment of the output, x's and the output's row strides modulo 16) and
    no launch hooks are set; otherwise they take the front end again. The front end binds and
    specializes every argument on every call, which is most of an eager call's host time. See `gemv` for the parameters."""

    def __init__(self, mw: MmaWeights, bias: torch.Tensor | None, m: int, device: torch.device, *,
                 num_warps: int = 4, tiles: int = 1, rows: int = 1, warps_n: int = 1, split_k: int = 1,
                 maxnreg: int | None = None, pdl: bool = False, prefetch: int = 0, bf16: bool = False) -> None:
        if not 1 <= m <= 64:
            raise ValueError(f"the mma GEMV takes 1 to 64 rows of x, got {m}")
        if rows not in (1, 2, 4) or mw.qweight.shape[0] % rows:
            raise ValueError(f"rows (16-row tiles per warp) must be 1, 2 or {ROW_TILES_MAX}, got {rows}")
        if num_warps % warps_n:
            raise ValueError(f"warps_n ({warps_n}) must divide num_warps ({num_warps})")
        n, k = mw.out_features, mw.in_features
        cols = 1 << max(0, (triton.cdiv(m, 8) - 1).bit_length())  # column tiles of 8 x rows: 1, 2, 4 or 8
        split_k = clamp_split(max(1, min(split_k, triton.cdiv(k, TILE_K))), m, n)
        programs = triton.cdiv(n, 16 * rows * warps_n)
        self.m, self.n, self.bias = m, n, bias
        self.dtype = torch.bfloat16 if bf16 else torch.float16  # of x and the output
        self.grid = (programs, split_k)
        self.weights = (mw.qweight.data_ptr(), mw.scales, mw.zeros)
        ws, cnt = workspace(split_k, m, n, device), counters(device, programs * rows * cols)
        self.buffers = (ws, cnt, m, n, k, mw.qweight.shape[1], mw.scales.shape[1], mw.qweight.shape[0], split_k)
        asm, cons = asm_for(mw.bits, cols, bf16, k % TILE_K == 0, tiles, rows)
        self.constexprs = dict(group_size=mw.group_size, ASM=asm, CONS=cons, BITS=mw.bits, COLS=cols, NW=num_warps,
                               TILES=tiles, HAS_BIAS=bias is not None, ROWS=rows, WR=warps_n, SPLIT=split_k > 1,
                               PDL=pdl, PREFETCH=prefetch if pdl else 0)
        self.constexpr_values = tuple(self.constexprs.values())
        self.options = dict(num_warps=num_warps, launch_pdl=pdl, **({} if maxnreg is None else {"maxnreg": maxnreg}))
        self.compiled = None
        self.specialized = None
        self.direct = True

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """y [M, N] = x Wᵀ (+ bias) into `out` (allocated when None)."""
        if x.dtype != self.dtype or (out is not None and out.dtype != self.dtype):
            raise ValueError(f"this launch was set up for {self.dtype} x and output, got {x.dtype}"
                             + ("" if out is None else f" and {out.dtype}"))
        xs, xp = x.stride(), x.data_ptr()
        if xs[1] != 1 or xs[0] % 8 or xp % 16:
            x = x.contiguous()
            xs, xp = x.stride(), x.data_ptr()
        if out is None:
            out = torch.empty(self.m, self.n, dtype=x.dtype, device=x.device)
        out_stride = out.stride(0)
        args = (xp, *self.weights, out if self.bias is None else self.bias, out, *self.buffers, xs[0], out_stride)
        specialized = (out.data_ptr() % 16, xs[0] % 16, out_stride % 16)
        ck = self.compiled
        if ck is not None and specialized == self.specialized and not hooks_set():
            if run_compiled(ck, self.grid, args + self.constexpr_values):
                return out
            self.compiled, self.direct = None, False  # another launcher convention: front end from now on
        ck = compiled_form(mma_gemv_kernel[self.grid](*args, **self.constexprs, **self.options))
        if self.compiled is None and ck is not None and self.direct:  # none under the interpreter
            self.compiled, self.specialized = ck, specialized
        return out


def gemv(
    x: torch.Tensor,
    mw: MmaWeights,
    bias: torch.Tensor | None = None,
    *,
    num_warps: int = 4,
    tiles: int = 1,
    rows: int = 1,
    warps_n: int = 1,
    split_k: int = 1,
    maxnreg: int | None = None,
    pdl: bool = False,
    prefetch: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] · Wᵀ (+ bias) for M ≤ 64 on the tensor cores; x fp16 (or bf16 with W4).

    A program takes 16·`rows`·`warps_n` output rows: its `num_warps` warps form `warps_n` groups of
    `rows` row tiles, the warps of a group split K between them, `tiles` K-tiles per asm call;
    `split_k` programs share each row range (K cut into that many slices, summed through a workspace).
    `maxnreg` is a register budget for ptxas (with several tiles it keeps all their loads in flight).
    `pdl` launches it with programmatic dependent launch (Hopper and later), `prefetch` K-tiles per warp
    asked of L2 before it waits for the previous kernel (see mma_gemv_kernel). Repeated calls on one
    layer should keep a `GemvLaunch` instead (less host time per call)."""
    launch = GemvLaunch(mw, bias, x.shape[0], x.device, num_warps=num_warps, tiles=tiles, rows=rows, warps_n=warps_n,
                        split_k=split_k, maxnreg=maxnreg, pdl=pdl, prefetch=prefetch, bf16=x.dtype == torch.bfloat16)
    return launch(x, out)


@triton.jit
def dequant_mma_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, KW, G, group_size: tl.constexpr,
                       BITS: tl.constexpr, TILES: tl.constexpr):
    """W [N, K] from the mma layout, one 16-row tile × TILES 128-input tiles per program. The blocks
    are loaded whole (contiguous) and permuted in registers to [row, tile] × [t, v, i] (each row's
    words in row order), then split into their values [t, c, 8]: W4 word 4·t + c holds inputs 32·c +
    8·t + (0…7) (the nibble for input offset o is o with its three bits reversed: W4_ORDER is its
    own inverse), W8 words 8·t + 2·c + h hold 32·c + 8·t + 4·h + (0…3) in byte order. Permuting
    [t, c] to [c, t] puts the tile in input order; a tile lies in one group. (Gathering each row's
    words from the blocks instead was 7–35 % slower.)"""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    PER_WORD: tl.constexpr = 32 // BITS
    WPT: tl.constexpr = 128 // PER_WORD  # words per row and tile
    TW: tl.constexpr = WPT // 4  # words per thread and row
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    HALF: tl.constexpr = dtype == tl.float16
    R: tl.constexpr = 16 * TILES
    i = tl.arange(0, R)
    n = pid_n * 16 + i // TILES
    tile = pid_t * TILES + i % TILES
    ok = (n < N) & (tile < tl.cdiv(K, 128))
    tiles = pid_t * TILES + tl.arange(0, TILES)
    b = tl.arange(0, WPT * 16)
    raw = tl.load(w_ptr + pid_n.to(tl.int64) * KW + tiles[:, None] * (WPT * 16) + b[None, :],
                  mask=(tiles < tl.cdiv(K, 128))[:, None], other=0)
    raw = tl.reshape(raw, [TILES, 2, TW // 4, 8, 4, 4])  # (tile, row half, v, g, t, i)
    wt = tl.reshape(tl.permute(raw, (1, 3, 0, 4, 2, 5)), [R, WPT])  # rows 8·half + g, then tiles
    o = tl.arange(0, PER_WORD)
    if BITS == 4:
        shift = ((o & 1) * 4 + ((o >> 1) & 1) * 2 + (o >> 2)) * 4
    else:
        shift = o * 8
    q = (wt[:, :, None] >> shift[None, None, :]) & ((1 << BITS) - 1)  # [R, words, values]
    q = tl.reshape(tl.permute(tl.reshape(q, [R, 4, 4, 8]), (0, 2, 1, 3)), [R, 128])  # [t, c] → [c, t]
    gi = tl.minimum(tile * 128 // group_size, G - 1)
    zb, s = zero_bias_scale(tl.load(s_ptr + n * G + gi, mask=ok, other=0.0),
                             tl.load(z_ptr + n * G + gi, mask=ok, other=0).to(tl.int32), HALF)
    w = dequant_values(q, zb[:, None], s[:, None], HALF, dtype)
    offs_k = (tile * 128)[:, None] + tl.arange(0, 128)[None, :]
    tl.store(out_ptr + n.to(tl.int64)[:, None] * K + offs_k, w, mask=ok[:, None] & (offs_k < K))


_DEQUANT = KeptKernel(dequant_mma_kernel)


def dequantize(mw: MmaWeights, dtype: torch.dtype, tiles: int = 2, num_warps: int = 4,
               rows: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, K] in `dtype` from the mma layout, for the dequantize-then-cuBLAS path (pure Triton: runs
    under TRITON_INTERPRET too). `tiles` (a power of two) K-tiles per program. `rows` = (r0, r1), r0 a
    multiple of 16, dequantizes only output rows r0…r1 − 1, into `out` ([r1 − r0, K], contiguous) if
    given: a chunk of the weight, e.g. for a scratch buffer reused chunk after chunk."""
    n, k = mw.out_features, mw.in_features
    r0, r1 = (0, n) if rows is None else rows
    if r0 % 16 or not 0 <= r0 < r1 <= n:
        raise ValueError(f"rows must be 0 ≤ r0 < r1 ≤ {n} with r0 a multiple of 16, got {rows}")
    kw, g = mw.qweight.shape[1], mw.scales.shape[1]
    if g > 1 and mw.group_size % TILE_K:
        raise ValueError(f"the mma layout needs groups of whole {TILE_K}-input tiles, got group size {mw.group_size}")
    if out is None:
        out = torch.empty(r1 - r0, k, dtype=dtype, device=mw.qweight.device)
    if out.shape != (r1 - r0, k) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{r1 - r0}, {k}] tensor, got {tuple(out.shape)}")
    grid = (triton.cdiv(r1 - r0, 16), triton.cdiv(triton.cdiv(k, TILE_K), tiles))
    _DEQUANT(grid, (mw.qweight[r0 // 16:], mw.scales[r0:r1], mw.zeros[r0:r1], out, r1 - r0, k, kw, g,
                    mw.group_size, mw.bits, tiles), num_warps=num_warps)
    return out
