"""Tensor-core GEMV for M ≤ 16: the weight tile is the A operand of `mma.sync` m16n8k16, x the B operand.

At M = 1 a CUDA-core GEMV spends ≥ 2 instructions per weight (extract, convert, multiply-add) and in
practice about 4. Here one warp owns 16 output rows and walks K in tiles of 128 inputs; per tile and
thread it loads 4 words (W4) or 8 words (W8) of rows g and g + 8 (g = lane / 4) with 16-byte loads,
turns each word into fp16 pairs with one `lop3` per pair (W4: nibbles under the exponent of 1024, so
the pair reads 1024 + q; the odd nibbles are read in place as 1024 + 16·q and summed apart) or one
`prmt` per pair (W8), and hands them to `mma.sync` with fp32 accumulation. The offset
and the zero point leave through a second `mma` per step whose A operand is −(1024 + z) of the
row's group: Σ (1024 + q)·x − (1024 + z)·Σ x = Σ (q − z)·x, accumulated exactly in fp32 (the products
of fp16 values are exact). The scale multiplies once per group. The loop compiles to ≈ 1.95 SASS
instructions per weight (W4; the CUDA-core GEMV of triton_gemv needs ≈ 3.9).

The B operand's 8 columns carry 8 rows of x (16 with two mma per step), so M ≤ 8 costs what M = 1
does. The words are repacked once at load time (`pack_mma`) so that each thread's pairs meet 4-input
runs of x that are contiguous in memory: the thread's x for one tile is four 16-byte loads.

Layout (W4): K is cut into tiles of 128 inputs; tile T of row n holds 16 words, word 4·t + c covering
inputs 128·T + 32·c + 8·t + (0…7) with the nibble at bits 4·p holding input offset W4_ORDER[p]
(0, 4, 2, 6, 1, 5, 3, 7). W8: 32 words per tile, word 8·t + 2·c + h covering 128·T + 32·c + 8·t + 4·h + (0…3) in
byte order. K is padded with zero words to whole tiles; x beyond K is never loaded.

The inner loop is inline PTX (`tl.inline_asm_elementwise`, one element per thread), so this kernel
runs on NVIDIA GPUs only (sm_80 and later), not under TRITON_INTERPRET; the CPU tests execute the
generated PTX with a small interpreter, and `emulate` reproduces the arithmetic in torch. Figures and
the variants tried: BENCHMARKS.md ("Kernels") and bench/KERNELS_NOTES.md, items 14–24.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.triton_gemm import _dequant_values, _zero_bias_scale
from quantkit.kernels.triton_layout import KernelWeights, PackedWeights, unpack_block_planar
from quantkit.kernels.triton_splitk import clamp_split, counters, store_points, workspace

TILE_K = 128
# Step h of a word's two mma steps takes its two fp16 pairs from nibbles (p, p + 4), p = PAIR_NIBBLE[h][i]:
# the pair's inputs are offsets 4·h + 2·i and 4·h + 2·i + 1 of the word's 8. Odd p sit 4 bits up, so
# with fp16 the step with odd p reads them in place as 1024 + 16·q (one lop3, no shift).
PAIR_NIBBLE = ((0, 2), (1, 3))
W4_ORDER = tuple(  # input offset held by nibble p of a word
    next(4 * h + 2 * i + (p >= 4) for h in range(2) for i in range(2) if PAIR_NIBBLE[h][i] == p % 4)
    for p in range(8))


class MmaWeights(PackedWeights):
    """One layer's weights in the mma layout (module docstring): qweight int32 [N, tiles · words per
    tile]; scales and zeros as in the block-planar layout."""


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


def _blocks(words: torch.Tensor, bits: int, inverse: bool = False, n: int = 0) -> torch.Tensor:
    """Row words [N, KW] ↔ blocks [row tiles, KW · 16] (`inverse`: back to [n, KW])."""
    wpt = 4 if bits == 4 else 8
    if inverse:
        rt, per = words.shape
        kt = per // (64 * wpt)
        w = words.reshape(rt, kt, 2, wpt // 4, 8, 4, 4).permute(0, 2, 4, 1, 5, 3, 6)  # [r, half, g, T, t, v, i]
        return w.reshape(rt * 16, kt * 4 * wpt)[:n]
    rows, kw = -(-words.shape[0] // 16) * 16, words.shape[1]
    w = torch.zeros(rows, kw, dtype=torch.int32, device=words.device)
    w[:words.shape[0]] = words
    kt = kw // (4 * wpt)
    w = w.reshape(rows // 16, 2, 8, kt, 4, wpt // 4, 4).permute(0, 3, 1, 5, 2, 4, 6)  # [r, T, half, v, g, t, i]
    return w.reshape(rows // 16, kt * 64 * wpt).contiguous()


def pack_mma(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers q [N, K] in 0..2^b−1 → int32 [row tiles, words] in the mma layout."""
    return _blocks(_row_words(q, bits), bits)


def unpack_mma(qweight: torch.Tensor, bits: int, k: int, n: int) -> torch.Tensor:
    """The inverse of `pack_mma` (for tests and checks): int64 [n, K]."""
    words = _blocks(qweight, bits, inverse=True, n=n)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=qweight.device)
    vals = (words.to(torch.int64)[..., None] >> shifts) & ((1 << bits) - 1)  # [N, words, per word]
    if bits == 4:
        vals = vals.reshape(n, -1, 4, 4, 8)  # (T, t, c, nibble)
        inv = torch.tensor([W4_ORDER.index(o) for o in range(8)], device=qweight.device)
        vals = vals[..., inv]
    else:
        vals = vals.reshape(n, -1, 4, 4, 8)  # (T, t, c, (h, byte))
    return vals.transpose(2, 3).reshape(n, -1)[:, :k]


def from_kernel_weights(kw: KernelWeights) -> MmaWeights:
    """The mma layout of a layer already in the block-planar kernel layout (same scales and zeros)."""
    q = unpack_block_planar(kw.qweight, kw.bits, kw.in_features)
    return MmaWeights(pack_mma(q, kw.bits), kw.scales, kw.zeros, kw.bits, kw.group_size, kw.in_features,
                      kw.out_features)


def _asm(bits: int, col_tiles: int, bf16: bool, even_k: bool, tiles: int) -> tuple[str, str]:
    """PTX for `tiles` K-tiles of one warp, and its constraints.

    Operands: outputs acc[8]; inputs per tile: word addresses of rows g and g + 8, x addresses of
    rows g and g + 8, inputs left for the thread's first chunk, the raw scales (fp16) and zero points
    (uint) of rows g and g + 8; then acc[8]. With one column tile acc[4:8] pass through.
    All loads are written first and the tiles' mma steps interleaved (step 0 of every tile, then
    step 1, ...). ptxas still schedules each load just before its first use and the independent chains
    one after the other unless given a register budget: with `maxnreg` (set by the dispatch for
    several tiles) all of the warp's weight loads are in flight together.
    Scales and zeros are converted here. Addresses always point at valid memory (the kernel clamps
    rows and tiles; a clamped tile has scale 0); only x beyond K is masked, and only when K is not a
    multiple of 128.
    """
    wpt = 4 if bits == 4 else 8  # words per row, thread and tile
    cons = ["=f"] * 8
    ops = []
    for _ in range(tiles):
        op = {}
        for name, c in [("wa", "l"), ("wa8", "l"), ("xa", "l"), ("xa8", "l"), ("kl", "r"), ("s", "h"), ("s8", "h"),
                        ("z", "r"), ("z8", "r")]:
            op[name] = f"${len(cons)}"
            cons.append(c)
        ops.append(op)
    acc_in = []
    for _ in range(8):
        acc_in.append(f"${len(cons)}")
        cons.append("f")

    n_acc = 4 * col_tiles
    x16 = bits == 4 and not bf16
    neg = "0xC300" if bf16 else "0xE400"  # −128 (bf16) / −1024 (fp16) with z in the low mantissa bits
    L = ["{",
         ".reg .pred px;",
         f".reg .b32 w<{2 * wpt * tiles}>, x<{16 * col_tiles * tiles}>, a<4>, sh, kt, "
         + ", ".join(f"{z}_{u}" for z in ("zg", "zg8", "zh", "zh8") for u in range(tiles)) + ";",
         f".reg .f32 d<{n_acc * tiles}>, e<{n_acc * tiles}>, sg, sg8;"]
    for u, op in enumerate(ops):
        wb = 2 * wpt * u
        for v in range(wpt // 4):
            for row, addr in ((0, op["wa"]), (wpt, op["wa8"])):
                regs = ", ".join(f"w{wb + row + 4 * v + i}" for i in range(4))
                L.append(f"ld.global.L1::no_allocate.v4.u32 {{{regs}}}, [{addr}+{512 * v}];")
    for u, op in enumerate(ops):
        L += _x_loads(col_tiles, even_k, u, op["xa"], op["xa8"], op["kl"])
        # The zero mma's A operands: −(1024 + z) (and −(1024 + 16·z) for the 16× steps) twice per word.
        for dst, src, shift in (("zg", op["z"], 0), ("zg8", op["z8"], 0), ("zh", op["z"], 4), ("zh8", op["z8"], 4)):
            if shift and not x16:
                continue
            if shift:
                L.append(f"shl.b32 sh, {src}, {shift};")
                src = "sh"
            L.append(f"or.b32 {dst}_{u}, {src}, {neg};")
            L.append(f"prmt.b32 {dst}_{u}, {dst}_{u}, {dst}_{u}, 0x1010;")
    L += _mma_steps(bits, col_tiles, bf16, tiles)
    prev = acc_in
    for u, op in enumerate(ops):
        L += [f"cvt.f32.f16 sg, {op['s']};", f"cvt.f32.f16 sg8, {op['s8']};"]
        L += _scale_into(n_acc, x16, u, prev)
        prev = [f"${i}" for i in range(n_acc)]
    L += [f"mov.f32 ${i}, {acc_in[i]};" for i in range(n_acc, 8)]
    L.append("}")
    return "\n".join(L), ",".join(cons)


def _x_loads(col_tiles: int, even_k: bool, u: int, xa: str, xa8: str, kl: str) -> list[str]:
    """Tile u's x (the B operands) into x<16·(col_tiles·u + nt) + …>: four 16-byte loads per column
    tile from the addresses `xa` (x rows g) and `xa8` (rows g + 8); with an odd K the runs at or past
    `kl` inputs left are not loaded and read as zero."""
    L = []
    for nt in range(col_tiles):
        base = xa if nt == 0 else xa8
        for c in range(4):
            xb = 16 * (col_tiles * u + nt) + 4 * c
            xs = ", ".join(f"x{xb + i}" for i in range(4))
            if even_k:
                L.append(f"ld.global.v4.u32 {{{xs}}}, [{base}+{64 * c}];")
            else:
                L.append(f"sub.s32 kt, {kl}, {32 * c};")
                L.append("setp.gt.s32 px, kt, 0;")
                L += [f"mov.b32 x{xb + i}, 0;" for i in range(4)]
                L.append(f"@px ld.global.v4.u32 {{{xs}}}, [{base}+{64 * c}];")
    return L


def _mma_steps(bits: int, col_tiles: int, bf16: bool, tiles: int) -> list[str]:
    """The mma steps of `tiles` loaded tiles into fresh fp32 sums d (and e for the odd nibbles read as
    1024 + 16·q): words w<2·wpt·u + …> (rows g, then g + 8), x as `_x_loads` leaves it, the zero mma's
    operands in zg_u, zg8_u (zh_u, zh8_u for the 16× steps). Step 0 of every tile, then step 1, …"""
    wpt = 4 if bits == 4 else 8
    n_acc = 4 * col_tiles
    x16 = bits == 4 and not bf16
    magic = "0x43004300" if bf16 else "0x64006400"
    ab = "bf16" if bf16 else "f16"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32"
    L = [f"mov.f32 d{i}, 0f00000000;" for i in range(n_acc * tiles)]
    if x16:
        L += [f"mov.f32 e{i}, 0f00000000;" for i in range(n_acc * tiles)]
    for c in range(4):
        for h in range(2):
            for u in range(tiles):
                wb = 2 * wpt * u
                acc, za, zb = "d", f"zg_{u}", f"zg8_{u}"
                if bits == 4:
                    for which, word in ((0, f"w{wb + c}"), (1, f"w{wb + wpt + c}")):
                        for i, p in enumerate(PAIR_NIBBLE[h]):
                            odd = x16 and p % 2
                            shift = 4 * (p - 1) if odd else 4 * p
                            src = word
                            if shift:
                                L.append(f"shr.b32 sh, {word}, {shift};")
                                src = "sh"
                            mask = "0x00F000F0" if odd else "0x000F000F"
                            L.append(f"lop3.b32 a{which + 2 * i}, {src}, {mask}, {magic}, 0xEA;")
                    if x16 and h == 1:
                        acc, za, zb = "e", f"zh_{u}", f"zh8_{u}"
                else:
                    for which, word in ((0, f"w{wb + 2 * c + h}"), (1, f"w{wb + wpt + 2 * c + h}")):
                        L.append(f"prmt.b32 a{which}, {word}, 0x64646464, 0x4140;")
                        L.append(f"prmt.b32 a{which + 2}, {word}, 0x64646464, 0x4342;")
                for nt in range(col_tiles):
                    xb = 16 * (col_tiles * u + nt) + 4 * c + 2 * h
                    dd = ", ".join(f"{acc}{n_acc * u + 4 * nt + i}" for i in range(4))
                    L.append(f"{mma} {{{dd}}}, {{a0, a1, a2, a3}}, {{x{xb}, x{xb + 1}}}, {{{dd}}};")
                    L.append(f"{mma} {{{dd}}}, {{{za}, {zb}, {za}, {zb}}}, {{x{xb}, x{xb + 1}}}, {{{dd}}};")
    return L


def _scale_into(n_acc: int, x16: bool, u: int, prev: list[str]) -> list[str]:
    """$i = scale of the row (sg / sg8) · tile u's sum (d + e / 16) + prev[i]."""
    L = []
    for i in range(n_acc):
        j = n_acc * u + i
        if x16:
            L.append(f"fma.rn.f32 d{j}, e{j}, 0f3D800000, d{j};")  # + e / 16
        L.append(f"fma.rn.f32 ${i}, {'sg' if i % 4 < 2 else 'sg8'}, d{j}, {prev[i]};")
    return L


def _asm_wide(bits: int, col_tiles: int, bf16: bool, even_k: bool, tiles: int) -> tuple[str, str]:
    """PTX for `tiles` K-tiles of one warp with up to 8 column tiles (M ≤ 64), and its constraints.

    Unlike `_asm`, the zero point is taken off the weights before the mma: one `fma` per fp16 pair,
    (1024 + q)·1 − (1024 + z) (odd nibbles: (1024 + 16·q)·1/16 − (64 + z)), exact in fp16 and bf16, so
    each step costs one mma per column tile instead of two, and no second accumulator is needed.
    x is loaded per 32-input chunk. Operands: outputs acc[4·col_tiles]; inputs per tile: word
    addresses of rows g and g + 8, x address of x row g (clamped to M − 1), inputs left, raw scales
    and zeros of rows g and g + 8; then the byte distance of 8 x rows and M − g (column tile c reads
    x rows 8·c + g while they are < M, zeros past them); then acc[4·col_tiles].
    """
    wpt = 4 if bits == 4 else 8
    n_acc = 4 * col_tiles
    cons = ["=f"] * n_acc
    ops = []
    for _ in range(tiles):
        op = {}
        for name, c in [("wa", "l"), ("wa8", "l"), ("xa", "l"), ("kl", "r"), ("s", "h"), ("s8", "h"), ("z", "r"),
                        ("z8", "r")]:
            op[name] = f"${len(cons)}"
            cons.append(c)
        ops.append(op)
    xs, mg = f"${len(cons)}", f"${len(cons) + 1}"
    cons += ["l", "r"]
    acc_in = [f"${len(cons) + i}" for i in range(n_acc)]
    cons += ["f"] * n_acc
    x16 = bits == 4 and not bf16
    magic = "0x43004300" if bf16 else "0x64006400"
    ab = "bf16" if bf16 else "f16"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32"
    one = "0x3F803F80" if bf16 else "0x3C003C00"
    L = ["{",
         ".reg .pred px, pr;",
         f".reg .b32 w<{2 * wpt * tiles}>, x<{16 * col_tiles * tiles}>, a<4>, sh, kt, mt, one, sixteenth, "
         + ", ".join(f"{z}_{u}" for z in ("zg", "zg8", "zh", "zh8") for u in range(tiles)) + ";",
         f".reg .f32 d<{n_acc * tiles}>, sg, sg8;",
         f".reg .b64 xc<{col_tiles}>;",
         f"mov.b32 one, {one};", "mov.b32 sixteenth, 0x2C002C00;"]
    for u, op in enumerate(ops):
        wb = 2 * wpt * u
        for v in range(wpt // 4):
            for row, addr in ((0, op["wa"]), (wpt, op["wa8"])):
                regs = ", ".join(f"w{wb + row + 4 * v + i}" for i in range(4))
                L.append(f"ld.global.L1::no_allocate.v4.u32 {{{regs}}}, [{addr}+{512 * v}];")
    for u, op in enumerate(ops):
        # −(1024 + z) (bf16: −(128 + z)) per row, twice per word; odd nibbles: −(64 + z), z·16 in the mantissa.
        for dst, src, shift, base in (("zg", op["z"], 0, "0xE400"), ("zg8", op["z8"], 0, "0xE400"),
                                      ("zh", op["z"], 4, "0xD400"), ("zh8", op["z8"], 4, "0xD400")):
            if shift and not x16:
                continue
            if shift:
                L.append(f"shl.b32 sh, {src}, {shift};")
                src = "sh"
            L.append(f"or.b32 {dst}_{u}, {src}, {'0xC300' if bf16 else base};")
            L.append(f"prmt.b32 {dst}_{u}, {dst}_{u}, {dst}_{u}, 0x1010;")
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
                if nt:
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
                wb = 2 * wpt * u
                if bits == 4:
                    for which, word in ((0, f"w{wb + c}"), (1, f"w{wb + wpt + c}")):
                        z = f"zg_{u}" if which == 0 else f"zg8_{u}"
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
                        z = f"zg_{u}" if which == 0 else f"zg8_{u}"
                        L.append(f"prmt.b32 a{which}, {word}, 0x64646464, 0x4140;")
                        L.append(f"prmt.b32 a{which + 2}, {word}, 0x64646464, 0x4342;")
                        L.append(f"fma.rn.f16x2 a{which}, a{which}, one, {z};")
                        L.append(f"fma.rn.f16x2 a{which + 2}, a{which + 2}, one, {z};")
                for nt in range(col_tiles):
                    xb = 16 * (col_tiles * u + nt) + 4 * c + 2 * h
                    dd = ", ".join(f"d{n_acc * u + 4 * nt + i}" for i in range(4))
                    L.append(f"{mma} {{{dd}}}, {{a0, a1, a2, a3}}, {{x{xb}, x{xb + 1}}}, {{{dd}}};")
    prev = acc_in
    for u, op in enumerate(ops):
        L += [f"cvt.f32.f16 sg, {op['s']};", f"cvt.f32.f16 sg8, {op['s8']};"]
        L += _scale_into(n_acc, False, u, prev)
        prev = [f"${i}" for i in range(n_acc)]
    L.append("}")
    return "\n".join(L), ",".join(cons)


_ASM: dict = {}


def asm_for(bits: int, col_tiles: int, bf16: bool, even_k: bool, tiles: int, wide: bool = False) -> tuple[str, str]:
    """The cached PTX and constraints of one configuration (`wide`: `_asm_wide`)."""
    key = (bits, col_tiles, bf16, even_k, tiles, wide)
    if key not in _ASM:
        _ASM[key] = (_asm_wide if wide else _asm)(bits, col_tiles, bf16, even_k, tiles)
    return _ASM[key]



@triton.jit
def _tile(tile, hi, w_row, w_row8, x_row, x_row8, s_row, z_row, row_ok, row8_ok, t, K, G,
          group_size: tl.constexpr, TILE_BYTES: tl.constexpr):
    """One tile's operands for each thread: word and x addresses, inputs left, raw scales and zeros
    of rows g and g + 8. A tile past `hi` is clamped to valid memory and gets scale 0."""
    ok = tile < hi
    tc = tl.minimum(tile, hi - 1).to(tl.int64)
    gi = tl.minimum(tc * 128 // group_size, G - 1).to(tl.int32)
    s = tl.load(s_row + gi, mask=ok & row_ok, other=0.0)
    s8 = tl.load(s_row + 8 * G + gi, mask=ok & row8_ok, other=0.0)
    z = tl.load(z_row + gi, mask=ok & row_ok, other=0).to(tl.int32)
    z8 = tl.load(z_row + 8 * G + gi, mask=ok & row8_ok, other=0).to(tl.int32)
    kl = (K - tc * 128 - t * 8).to(tl.int32)
    return (w_row + tc * TILE_BYTES, w_row8 + tc * TILE_BYTES, x_row + tc * 256, x_row8 + tc * 256, kl,
            s, s8, z, z8)


@triton.jit
def _tile_wide(tile, hi, w_row, w_row8, x_row, s_row, z_row, row_ok, row8_ok, t, K, G,
               group_size: tl.constexpr, TILE_BYTES: tl.constexpr):
    """`_tile` for the wide asm: one x address (row g); the other column tiles are offsets from it."""
    wa, wa8, xa, xa8, kl, s, s8, z, z8 = _tile(tile, hi, w_row, w_row8, x_row, x_row, s_row, z_row, row_ok, row8_ok,
                                               t, K, G, group_size, TILE_BYTES)
    return wa, wa8, xa, kl, s, s8, z, z8


@triton.jit
def mma_gemv_kernel(
    x_addr, w_addr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, KW, G, stride_xm, stride_om, group_size: tl.constexpr,
    ASM: tl.constexpr, CONS: tl.constexpr, BITS: tl.constexpr, COLS: tl.constexpr, NW: tl.constexpr,
    TILES: tl.constexpr,
    SPLIT_K, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, WIDE: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    T: tl.constexpr = 32 * NW
    WPT: tl.constexpr = 4 if BITS == 4 else 8
    e = tl.arange(0, T)
    warp = e // 32
    lane = e % 32
    g = lane // 4
    t = lane % 4
    row = pid_n * 16 + g
    row_ok = row < N
    row8_ok = row + 8 < N
    # Rows past N and x rows past M read valid memory (clamped); their outputs are never stored.
    # The program's blocks (module docstring): thread (g, t) reads bytes 16·lane of each 512-byte chunk.
    w_row = w_addr + pid_n.to(tl.int64) * KW * 4 + lane * 16
    w_row8 = w_row + WPT * 128
    TILE_BYTES: tl.constexpr = WPT * 256
    x_row = x_addr + tl.minimum(g, M - 1).to(tl.int64) * stride_xm * 2 + t * 16
    x_row8 = x_addr + tl.minimum(g + 8, M - 1).to(tl.int64) * stride_xm * 2 + t * 16
    s_row = s_ptr + row * G
    z_row = z_ptr + row * G
    n_tiles = tl.cdiv(K, 128)
    per = tl.cdiv(n_tiles, SPLIT_K)
    lo = pid_k * per
    hi = tl.minimum(lo + per, n_tiles)
    zero = tl.zeros([T], dtype=tl.float32)
    acc = (zero, zero, zero, zero, zero, zero, zero, zero)
    tile = lo + warp  # warp w takes tiles lo + w, lo + w + NW, ...
    if WIDE:
        acc = (zero,) * (4 * COLS)
        rows8 = stride_xm.to(tl.int64) * 16 + e * 0  # bytes of 8 x rows, per thread
        m_left = M - g
    for _ in range(0, tl.cdiv(hi - lo, NW * TILES)):
        if WIDE:
            ops = _tile_wide(tile, hi, w_row, w_row8, x_row, s_row, z_row, row_ok, row8_ok, t, K, G, group_size,
                             TILE_BYTES)
            for u in tl.static_range(1, TILES):
                ops = ops + _tile_wide(tile + u * NW, hi, w_row, w_row8, x_row, s_row, z_row, row_ok, row8_ok, t, K,
                                       G, group_size, TILE_BYTES)
            acc = tl.inline_asm_elementwise(ASM, CONS, ops + (rows8, m_left) + acc, dtype=(tl.float32,) * (4 * COLS),
                                            is_pure=True, pack=1)
        else:
            ops = _tile(tile, hi, w_row, w_row8, x_row, x_row8, s_row, z_row, row_ok, row8_ok, t, K, G, group_size,
                        TILE_BYTES)
            for u in tl.static_range(1, TILES):
                ops = ops + _tile(tile + u * NW, hi, w_row, w_row8, x_row, x_row8, s_row, z_row, row_ok, row8_ok, t,
                                  K, G, group_size, TILE_BYTES)
            acc = tl.inline_asm_elementwise(ASM, CONS, ops + acc, dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        tile += NW * TILES
    if WIDE:  # one store per column tile (no split-K)
        lane32 = tl.arange(0, 32)
        n0 = pid_n * 16 + lane32 // 4
        m0 = (lane32 % 4) * 2
        offs_m = _pairs(m0, m0 + 1, m0, m0 + 1)
        offs_n = _pairs(n0, n0, n0 + 8, n0 + 8)
        for nt in tl.static_range(COLS):
            vals = _pairs(_warp_sum(acc[4 * nt], NW), _warp_sum(acc[4 * nt + 1], NW), _warp_sum(acc[4 * nt + 2], NW),
                          _warp_sum(acc[4 * nt + 3], NW))
            store_points(vals, offs_m + 8 * nt, offs_n, M, N, out_ptr, stride_om, bias_ptr, ws_ptr, cnt_ptr, pid_n, 0,
                         1, False, HAS_BIAS)
    else:
        _store_acc(acc, pid_n, pid_k, M, N, out_ptr, stride_om, bias_ptr, ws_ptr, cnt_ptr, SPLIT_K, SPLIT, HAS_BIAS,
                   NW, COLS)


@triton.jit
def _store_acc(acc, pid_n, pid_k, M, N, out_ptr, stride_om, bias_ptr, ws_ptr, cnt_ptr, SPLIT_K,
               SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, NW: tl.constexpr, COLS: tl.constexpr):
    """Sum the warps' K slices of the mma fragments `acc` and write them (through split-K if SPLIT)."""
    # Lane (g, t) then holds rows g and g + 8 for x rows 2t and 2t + 1.
    lane32 = tl.arange(0, 32)
    n0 = pid_n * 16 + lane32 // 4
    m0 = (lane32 % 4) * 2
    vals = _pairs(_warp_sum(acc[0], NW), _warp_sum(acc[1], NW), _warp_sum(acc[2], NW), _warp_sum(acc[3], NW))
    offs_m = _pairs(m0, m0 + 1, m0, m0 + 1)
    offs_n = _pairs(n0, n0, n0 + 8, n0 + 8)
    if COLS == 2:
        vals = tl.reshape(tl.join(vals, _pairs(_warp_sum(acc[4], NW), _warp_sum(acc[5], NW), _warp_sum(acc[6], NW),
                                               _warp_sum(acc[7], NW))), [256])
        offs_m = tl.reshape(tl.join(offs_m, offs_m + 8), [256])
        offs_n = tl.reshape(tl.join(offs_n, offs_n), [256])
    store_points(vals, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, ws_ptr, cnt_ptr, pid_n, pid_k,
                 SPLIT_K, SPLIT, HAS_BIAS)


@triton.jit
def _warp_sum(a, NW: tl.constexpr):
    return tl.sum(tl.reshape(a, [NW, 32]), axis=0)


@triton.jit
def _pairs(p, q, r, s):
    """Four [32] vectors as one [128] vector."""
    return tl.reshape(tl.join(tl.join(p, q), tl.join(r, s)), [128])


def gemv(
    x: torch.Tensor,
    mw: MmaWeights,
    bias: torch.Tensor | None = None,
    *,
    num_warps: int = 4,
    split_k: int = 1,
    tiles: int = 1,
    maxnreg: int | None = None,
    wide: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] · Wᵀ (+ bias) on the tensor cores; x fp16 (or bf16 with W4).

    M ≤ 16, or M ≤ 64 with `wide` (`_asm_wide`: zero point off the weights, one mma per column tile;
    no split-K)."""
    m, k = x.shape
    limit = 64 if wide else 16
    if m > limit:
        raise ValueError(f"the mma GEMV takes at most {limit} rows of x, got {m}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    n = mw.out_features
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split_k = 1 if wide else clamp_split(max(1, min(split_k, triton.cdiv(k, TILE_K))), m, n)
    ws = workspace(split_k, m, n, x.device)
    row_tiles = triton.cdiv(n, 16)
    cols = 1 << max(0, (triton.cdiv(m, 8) - 1).bit_length()) if wide else (1 if m <= 8 else 2)
    asm, cons = asm_for(mw.bits, cols, x.dtype == torch.bfloat16, k % TILE_K == 0, tiles, wide)
    mma_gemv_kernel[(row_tiles, split_k)](
        x.data_ptr(), mw.qweight.data_ptr(), mw.scales, mw.zeros, bias if bias is not None else out, out, ws,
        counters(x.device, row_tiles), m, n, k, mw.qweight.shape[1], mw.scales.shape[1], x.stride(0), out.stride(0),
        group_size=mw.group_size, ASM=asm, CONS=cons, BITS=mw.bits, COLS=cols, NW=num_warps, TILES=tiles,
        SPLIT_K=split_k, SPLIT=split_k > 1, HAS_BIAS=bias is not None, WIDE=wide,
        num_warps=num_warps, **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    return out


@triton.jit
def dequant_mma_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, KW, G, group_size: tl.constexpr,
                       BITS: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr):
    """W [N, K] from the mma layout, BLOCK_N rows × TILES 128-input tiles per program. Per (row, tile)
    the words are loaded contiguously and split into their values [t, c, 8]: W4 word 4·t + c holds
    inputs 32·c + 8·t + (0…7) (the nibble for input offset o is o with its three bits reversed:
    W4_ORDER is its own inverse), W8 words 8·t + 2·c + h hold 32·c + 8·t + 4·h + (0…3) in byte order.
    Permuting [t, c] to [c, t] puts the tile in input order; a tile lies in one group."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    PER_WORD: tl.constexpr = 32 // BITS
    WPT: tl.constexpr = 128 // PER_WORD  # words per row and tile
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    HALF: tl.constexpr = dtype == tl.float16
    R: tl.constexpr = BLOCK_N * TILES
    i = tl.arange(0, R)
    n = pid_n * BLOCK_N + i // TILES
    tile = pid_t * TILES + i % TILES
    ok = (n < N) & (tile < tl.cdiv(K, 128))
    # Word j of row n's share of the tile sits in block (n // 16, tile) at chunk (row half, j % wpt // 4),
    # lane 4·(n % 8) + j // wpt, word j % 4 (module docstring).
    j = tl.arange(0, WPT)
    TW: tl.constexpr = WPT // 4  # words per thread and row
    block = (n // 16).to(tl.int64) * KW + tile * (WPT * 16)
    in_row = ((n % 16) // 8 * (TW // 4)) * 128 + (n % 8) * 16
    in_word = (j % TW // 4) * 128 + (j // TW) * 4 + j % 4
    wt = tl.load(w_ptr + (block + in_row)[:, None] + in_word[None, :], mask=ok[:, None], other=0)
    o = tl.arange(0, PER_WORD)
    if BITS == 4:
        shift = ((o & 1) * 4 + ((o >> 1) & 1) * 2 + (o >> 2)) * 4
    else:
        shift = o * 8
    q = (wt[:, :, None] >> shift[None, None, :]) & ((1 << BITS) - 1)  # [R, words, values]
    q = tl.reshape(tl.permute(tl.reshape(q, [R, 4, 4, 8]), (0, 2, 1, 3)), [R, 128])  # [t, c] → [c, t]
    gi = tl.minimum(tile * 128 // group_size, G - 1)
    zb, s = _zero_bias_scale(tl.load(s_ptr + n * G + gi, mask=ok, other=0.0),
                             tl.load(z_ptr + n * G + gi, mask=ok, other=0).to(tl.int32), HALF)
    w = _dequant_values(q, zb[:, None], s[:, None], HALF, dtype)
    offs_k = (tile * 128)[:, None] + tl.arange(0, 128)[None, :]
    tl.store(out_ptr + n.to(tl.int64)[:, None] * K + offs_k, w, mask=ok[:, None] & (offs_k < K))


def dequantize(mw: MmaWeights, dtype: torch.dtype, block_n: int = 16, tiles: int = 2, num_warps: int = 4) -> torch.Tensor:
    """W [N, K] in `dtype` from the mma layout, for the dequantize-then-cuBLAS path (pure Triton: runs
    under TRITON_INTERPRET too)."""
    n, k = mw.out_features, mw.in_features
    kw, g = mw.qweight.shape[1], mw.scales.shape[1]
    if g > 1 and mw.group_size % TILE_K:
        raise ValueError(f"the mma layout needs groups of whole {TILE_K}-input tiles, got group size {mw.group_size}")
    out = torch.empty(n, k, dtype=dtype, device=mw.qweight.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(triton.cdiv(k, TILE_K), tiles))
    dequant_mma_kernel[grid](mw.qweight, mw.scales, mw.zeros, out, n, k, kw, g, group_size=mw.group_size,
                             BITS=mw.bits, BLOCK_N=block_n, TILES=tiles, num_warps=num_warps)
    return out


def emulate(x: torch.Tensor, mw: MmaWeights) -> torch.Tensor:
    """What the kernel computes, in torch on any device, following its operands (for the CPU tests):
    fp16 pairs 1024 + q from the words, x pairs in the slots the layout assigns, the zero mma, fp32
    sums per group, the scale once per group. Returns fp32 [M, N]."""
    m, k = x.shape
    n = mw.out_features
    kp = -(-k // TILE_K) * TILE_K
    words = _blocks(mw.qweight, mw.bits, inverse=True, n=n).to(torch.int64) & 0xFFFFFFFF
    xs = torch.zeros(m, kp, dtype=torch.float32, device=x.device)
    xs[:, :k] = x.float()
    if mw.bits == 4:
        # pair i of step h: nibbles (p, p + 4), p = PAIR_NIBBLE[h][i] → input offsets 4h + 2i, 4h + 2i + 1
        pieces = []
        for h in range(2):
            for p in PAIR_NIBBLE[h]:
                pieces += [(words >> (4 * p)) & 0xF, (words >> (4 * p + 16)) & 0xF]
        vals = torch.stack(pieces, -1)  # input offsets 0..7 in order
    else:
        vals = torch.stack([(words >> s) & 0xFF for s in (0, 8, 16, 24)], -1)  # offsets 0..3 of (t, c, h)
    a = (vals.to(torch.float32) + 1024.0).reshape(n, kp // TILE_K, 4, 4, 8).transpose(2, 3).reshape(n, kp)
    groups = torch.div(torch.arange(kp, device=x.device), mw.group_size, rounding_mode="floor").clamp(max=mw.scales.shape[1] - 1)
    z = mw.zeros.to(torch.float32)[:, groups] + 1024.0
    s = mw.scales.to(torch.float32)
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    for gi in range(mw.scales.shape[1]):
        sel = groups == gi
        part = xs[:, sel] @ (a[:, sel] - z[:, sel]).t()
        out += part * s[:, gi]
    return out
