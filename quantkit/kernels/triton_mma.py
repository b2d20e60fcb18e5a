"""Tensor-core GEMV for M ≤ 16: the weight tile is the A operand of `mma.sync` m16n8k16, x the B operand.

At M = 1 a CUDA-core GEMV spends ≥ 2 instructions per weight (extract, convert, multiply-add) and in
practice about 4. Here one warp owns 16 output rows and walks K in tiles of 128 inputs; per tile and
thread it loads 4 words (W4) or 8 words (W8) of rows g and g + 8 (g = lane / 4) with 16-byte loads,
turns each word into fp16 pairs with one `lop3` (W4: nibbles under the exponent of 1024, so the pair
reads 1024 + q) or one `prmt` (W8), and hands them to `mma.sync` with fp32 accumulation. The offset
and the zero point leave through a second `mma` per step whose A operand is −(1024 + z) of the
row's group: Σ (1024 + q)·x − (1024 + z)·Σ x = Σ (q − z)·x, accumulated exactly in fp32 (the products
of fp16 values are exact). The scale multiplies once per group. About 1.1 instructions per weight.

The B operand's 8 columns carry 8 rows of x (16 with two mma per step), so M ≤ 8 costs what M = 1
does. The words are repacked once at load time (`pack_mma`) so that each thread's pairs meet 4-input
runs of x that are contiguous in memory: the thread's x for one tile is four 16-byte loads.

Layout (W4): K is cut into tiles of 128 inputs; tile T of row n holds 16 words, word 4·t + c covering
inputs 128·T + 32·c + 8·t + (0…7) with the nibble at bits 4·p holding input offset [0, 2, 4, 6, 1, 3,
5, 7][p]. W8: 32 words per tile, word 8·t + 2·c + h covering 128·T + 32·c + 8·t + 4·h + (0…3) in
byte order. K is padded with zero words to whole tiles; x beyond K is never loaded.

The inner loop is inline PTX (`tl.inline_asm_elementwise`, one element per thread), so this kernel
runs on NVIDIA GPUs only (sm_80 and later), not under TRITON_INTERPRET; `emulate` reproduces its
register-level arithmetic in torch for the CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quantkit.kernels.triton_layout import KernelWeights, unpack_block_planar
from quantkit.kernels.triton_splitk import clamp_split, counters, store_points, workspace

TILE_K = 128
# Step h of a word's two mma steps takes its two fp16 pairs from nibbles (p, p + 4), p = PAIR_NIBBLE[h][i]:
# the pair's inputs are offsets 4·h + 2·i and 4·h + 2·i + 1 of the word's 8. Odd p sit 4 bits up, so
# with fp16 the step with odd p reads them in place as 1024 + 16·q (one lop3, no shift).
PAIR_NIBBLE = ((0, 2), (1, 3))
W4_ORDER = tuple(  # input offset held by nibble p of a word
    next(4 * h + 2 * i + (p >= 4) for h in range(2) for i in range(2) if PAIR_NIBBLE[h][i] == p % 4)
    for p in range(8))


@dataclass
class MmaWeights:
    """One layer's weights in the mma layout (module docstring); scales and zeros as in KernelWeights."""

    qweight: torch.Tensor  # int32 [N, tiles · words per tile]
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    in_features: int
    out_features: int

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads for the weight: packed integers, scales and zeros."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))


def supports(bits: int, group_size: int, in_features: int, groups: int, dtype: torch.dtype) -> bool:
    """Whether the mma kernel takes this layer: groups of whole 128-input tiles (or one group per row),
    fp16 activations, or bf16 with 4-bit weights (bf16 holds 128 + q exactly only for q < 128)."""
    whole = groups == 1 or group_size % TILE_K == 0
    return whole and in_features % 8 == 0 and (dtype == torch.float16 or (dtype == torch.bfloat16 and bits == 4))


def pack_mma(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers q [N, K] in 0..2^b−1 → int32 [N, words] in the mma layout."""
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
    return words.to(torch.int32).reshape(n, -1).contiguous()


def unpack_mma(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """The inverse of `pack_mma` (for tests): int64 [N, K]."""
    n = qweight.shape[0]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=qweight.device)
    vals = (qweight.to(torch.int64)[..., None] >> shifts) & ((1 << bits) - 1)  # [N, words, per word]
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


def _asm(bits: int, col_tiles: int, tiles: int, warps: int, bf16: bool, even_k: bool,
         preloaded: bool = False) -> tuple[str, str]:
    """PTX for `tiles` K-tiles of one warp (all loads first, then the mma steps) and its constraints.

    Operands: outputs acc[8]; inputs per tile (w address rows g and g+8, x address rows g and g+8,
    inputs left for the thread's first chunk, scales g and g+8 (fp32), zero pairs g and g+8, and the
    same pairs for the 16× plane), then acc[8]. With one column tile, acc[4:8] pass through.
    Addresses always point at valid memory (the launcher clamps rows and tiles; a clamped tile has
    scale 0); only x beyond K is masked, and only when K is not a multiple of 128.
    `preloaded` (one tile): the words come as operands (rows g then g+8, see `_load_asm`) in place
    of their two addresses, loaded an iteration earlier.
    """
    wpt = 4 if bits == 4 else 8  # words per row, thread and tile
    cons = ["=f"] * 8
    per_tile = []
    for u in range(tiles):
        d = {}
        if preloaded:
            d["words"] = []
            for _ in range(2 * wpt):
                d["words"].append(f"${len(cons)}")
                cons.append("r")
        for name, c in [] if preloaded else [("wa", "l"), ("wa8", "l")]:
            d[name] = f"${len(cons)}"
            cons.append(c)
        for name, c in [("xa", "l"), ("xa8", "l"), ("kl", "r"), ("sg", "f"), ("sg8", "f"),
                        ("zg", "r"), ("zg8", "r"), ("zh", "r"), ("zh8", "r")]:
            d[name] = f"${len(cons)}"
            cons.append(c)
        per_tile.append(d)
    acc_in = []
    for _ in range(8):
        acc_in.append(f"${len(cons)}")
        cons.append("f")

    n_acc = 4 * col_tiles
    x16 = bits == 4 and not bf16  # odd nibbles read as 1024 + 16·q in place (no shift), summed apart
    magic = "0x43004300" if bf16 else "0x64006400"
    ab = "bf16" if bf16 else "f16"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32"
    L = ["{",
         f".reg .pred px<{4 * tiles}>;",
         f".reg .b32 w<{2 * wpt * tiles}>, x<{16 * col_tiles * tiles}>, a<4>, sh<2>;",
         f".reg .f32 d<{n_acc}>, e<{n_acc}>;",
         ".reg .s32 kt;"]
    for u in range(tiles):
        op = per_tile[u]
        wb = 2 * wpt * u
        if preloaded:
            L += [f"mov.b32 w{wb + i}, {r};" for i, r in enumerate(op["words"])]
        for v in range(0 if preloaded else wpt // 4):
            r = ", ".join(f"w{wb + 4 * v + i}" for i in range(4))
            r8 = ", ".join(f"w{wb + wpt + 4 * v + i}" for i in range(4))
            L.append(f"ld.global.L1::no_allocate.v4.u32 {{{r}}}, [{op['wa']}+{16 * v}];")
            L.append(f"ld.global.L1::no_allocate.v4.u32 {{{r8}}}, [{op['wa8']}+{16 * v}];")
        for nt in range(col_tiles):
            base = op["xa"] if nt == 0 else op["xa8"]
            for c in range(4):
                xs = [f"x{16 * (nt + col_tiles * u) + 4 * c + i}" for i in range(4)]
                if even_k:
                    L.append(f"ld.global.v4.u32 {{{', '.join(xs)}}}, [{base}+{64 * c}];")
                else:
                    if nt == 0:
                        L.append(f"sub.s32 kt, {op['kl']}, {32 * c};")
                        L.append(f"setp.gt.s32 px{4 * u + c}, kt, 0;")
                    L += [f"mov.b32 {r}, 0;" for r in xs]
                    L.append(f"@px{4 * u + c} ld.global.v4.u32 {{{', '.join(xs)}}}, [{base}+{64 * c}];")
    prev = acc_in
    for u in range(tiles):
        wb = 2 * wpt * u
        op = per_tile[u]
        L += [f"mov.f32 d{i}, 0f00000000;" for i in range(n_acc)]
        if x16:
            L += [f"mov.f32 e{i}, 0f00000000;" for i in range(n_acc)]
        for c in range(4):
            for h in range(2):
                acc, za, zb = "d", op["zg"], op["zg8"]
                if bits == 4:
                    for which, word in ((0, f"w{wb + c}"), (1, f"w{wb + wpt + c}")):
                        for i, p in enumerate(PAIR_NIBBLE[h]):
                            odd = x16 and p % 2  # read in place as 1024 + 16·q
                            shift = 4 * (p - 1) if odd else 4 * p
                            src = word
                            if shift:
                                L.append(f"shr.b32 sh0, {word}, {shift};")
                                src = "sh0"
                            mask = "0x00F000F0" if odd else "0x000F000F"
                            L.append(f"lop3.b32 a{which + 2 * i}, {src}, {mask}, {magic}, 0xEA;")
                    if x16 and h == 1:
                        acc, za, zb = "e", op["zh"], op["zh8"]
                else:
                    for which, word in ((0, f"w{wb + 2 * c + h}"), (1, f"w{wb + wpt + 2 * c + h}")):
                        L.append(f"prmt.b32 a{which}, {word}, 0x64646464, 0x4140;")
                        L.append(f"prmt.b32 a{which + 2}, {word}, 0x64646464, 0x4342;")
                for nt in range(col_tiles):
                    xb = 16 * (nt + col_tiles * u) + 4 * c + 2 * h
                    dd = ", ".join(f"{acc}{4 * nt + i}" for i in range(4))
                    L.append(f"{mma} {{{dd}}}, {{a0, a1, a2, a3}}, {{x{xb}, x{xb + 1}}}, {{{dd}}};")
                    L.append(f"{mma} {{{dd}}}, {{{za}, {zb}, {za}, {zb}}}, {{x{xb}, x{xb + 1}}}, {{{dd}}};")
        for i in range(n_acc):
            if x16:
                L.append(f"fma.rn.f32 d{i}, e{i}, 0f3D800000, d{i};")  # + e / 16
            s = op["sg"] if i % 4 < 2 else op["sg8"]
            L.append(f"fma.rn.f32 ${i}, {s}, d{i}, {prev[i]};")
        prev = [f"${i}" for i in range(n_acc)] + prev[n_acc:]
    for i in range(n_acc, 8):
        L.append(f"mov.f32 ${i}, {acc_in[i]};")
    L.append("}")
    return "\n".join(L), ",".join(cons)


def _load_asm(bits: int) -> tuple[str, str]:
    """PTX that loads one tile's words of rows g and g + 8 (16-byte loads that skip L1)."""
    wpt = 4 if bits == 4 else 8
    lines = []
    for row, addr in ((0, f"${2 * wpt}"), (1, f"${2 * wpt + 1}")):
        for v in range(wpt // 4):
            regs = ", ".join(f"${row * wpt + 4 * v + i}" for i in range(4))
            lines.append(f"ld.global.L1::no_allocate.v4.u32 {{{regs}}}, [{addr}+{16 * v}];")
    return "\n".join(lines), ",".join(["=r"] * (2 * wpt) + ["l", "l"])


_ASM: dict = {}


def asm_for(bits: int, col_tiles: int, tiles: int, warps: int, bf16: bool, even_k: bool,
            preloaded: bool = False) -> tuple[str, str]:
    """The cached PTX and constraints of one configuration."""
    key = (bits, col_tiles, tiles, warps, bf16, even_k, preloaded)
    if key not in _ASM:
        _ASM[key] = _asm(bits, col_tiles, tiles, warps, bf16, even_k, preloaded)
    return _ASM[key]


@triton.jit
def _zero_pairs(z_ptr, off, ok, BF16: tl.constexpr):
    """−(1024 + z) and −(1024 + 16·z) (fp16; bf16: −(128 + z)), each twice in one 32-bit word: the A
    operands of the zero mma for the plain and the 16× steps."""
    z = tl.load(z_ptr + off, mask=ok, other=0).to(tl.int32)
    if BF16:
        h = z | 0xC300
        h16 = h
    else:
        h = z | 0xE400
        h16 = (z << 4) | 0xE400
    return h | (h << 16), h16 | (h16 << 16)


@triton.jit
def _tile_operands(tile, hi, w_row, w_row8, x_row, x_row8, s_row, z_row, row_ok, row8_ok, t, K, G,
                   group_size: tl.constexpr, WPT: tl.constexpr, BF16: tl.constexpr):
    """One tile's inline-asm operands for each thread; a tile past `hi` is clamped and scaled by 0."""
    ok = tile < hi
    tc = tl.minimum(tile, hi - 1).to(tl.int64)
    gi = tl.minimum(tc * 128 // group_size, G - 1).to(tl.int32)
    sg = tl.load(s_row + gi, mask=ok & row_ok, other=0.0).to(tl.float32)
    sg8 = tl.load(s_row + 8 * G + gi, mask=ok & row8_ok, other=0.0).to(tl.float32)
    zg, zh = _zero_pairs(z_row, gi, ok & row_ok, BF16)
    zg8, zh8 = _zero_pairs(z_row + 8 * G, gi, ok & row8_ok, BF16)
    kl = (K - tc * 128 - t * 8).to(tl.int32)
    return (w_row + tc * (WPT * 16), w_row8 + tc * (WPT * 16), x_row + tc * 256, x_row8 + tc * 256, kl,
            sg, sg8, zg, zg8, zh, zh8)


@triton.jit
def mma_gemv_kernel(
    x_addr, w_addr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, KW, G, stride_xm, stride_om, group_size: tl.constexpr,
    ASM: tl.constexpr, CONS: tl.constexpr, BITS: tl.constexpr, COLS: tl.constexpr, TILES: tl.constexpr,
    NW: tl.constexpr, BF16: tl.constexpr, SPLIT_K, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    PREFETCH: tl.constexpr = False, LOAD_ASM: tl.constexpr = "", LOAD_CONS: tl.constexpr = "",
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
    w_row = w_addr + tl.minimum(row, N - 1).to(tl.int64) * KW * 4 + t * (WPT * 4)
    w_row8 = w_addr + tl.minimum(row + 8, N - 1).to(tl.int64) * KW * 4 + t * (WPT * 4)
    x_row = x_addr + tl.minimum(g, M - 1).to(tl.int64) * stride_xm * 2 + t * 16
    x_row8 = x_addr + tl.minimum(g + 8, M - 1).to(tl.int64) * stride_xm * 2 + t * 16
    s_row = s_ptr + row * G
    z_row = z_ptr + row * G
    n_tiles = tl.cdiv(K, 128)
    per = tl.cdiv(n_tiles, SPLIT_K)
    lo = pid_k * per
    hi = tl.minimum(lo + per, n_tiles)
    zero = tl.zeros([T], dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero
    if PREFETCH:
        # Software pipeline, one tile deep: the words (and scales) of the warp's next tile are loaded
        # before the current tile's mma steps run, so a warp always has a tile's loads in flight.
        tile = lo + warp
        p = _tile_operands(tile, hi, w_row, w_row8, x_row, x_row8, s_row, z_row, row_ok, row8_ok, t, K, G,
                           group_size, WPT, BF16)
        w = tl.inline_asm_elementwise(LOAD_ASM, LOAD_CONS, [p[0], p[1]], dtype=(tl.int32,) * (2 * WPT),
                                      is_pure=False, pack=1)
        for j in range(0, tl.cdiv(hi - lo, NW)):
            q = _tile_operands(tile + NW, hi, w_row, w_row8, x_row, x_row8, s_row, z_row, row_ok, row8_ok, t,
                               K, G, group_size, WPT, BF16)
            wn = tl.inline_asm_elementwise(LOAD_ASM, LOAD_CONS, [q[0], q[1]], dtype=(tl.int32,) * (2 * WPT),
                                           is_pure=False, pack=1)
            if WPT == 4:
                a0, a1, a2, a3, a4, a5, a6, a7 = tl.inline_asm_elementwise(
                    ASM, CONS, [w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7],
                                p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], p[10],
                                a0, a1, a2, a3, a4, a5, a6, a7],
                    dtype=(tl.float32,) * 8, is_pure=False, pack=1)
            else:
                a0, a1, a2, a3, a4, a5, a6, a7 = tl.inline_asm_elementwise(
                    ASM, CONS, [w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7],
                                w[8], w[9], w[10], w[11], w[12], w[13], w[14], w[15],
                                p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], p[10],
                                a0, a1, a2, a3, a4, a5, a6, a7],
                    dtype=(tl.float32,) * 8, is_pure=False, pack=1)
            w = wn
            p = q
            tile += NW
    else:
        for j in range(0, tl.cdiv(hi - lo, NW * TILES)):
            tile = lo + j * (NW * TILES) + warp  # this warp's first tile; the next is NW tiles on
            p0 = _tile_operands(tile, hi, w_row, w_row8, x_row, x_row8, s_row, z_row, row_ok, row8_ok, t, K, G,
                                group_size, WPT, BF16)
            if TILES == 2:
                p1 = _tile_operands(tile + NW, hi, w_row, w_row8, x_row, x_row8, s_row, z_row, row_ok, row8_ok, t,
                                    K, G, group_size, WPT, BF16)
                a0, a1, a2, a3, a4, a5, a6, a7 = tl.inline_asm_elementwise(
                    ASM, CONS, [p0[0], p0[1], p0[2], p0[3], p0[4], p0[5], p0[6], p0[7], p0[8], p0[9], p0[10],
                                p1[0], p1[1], p1[2], p1[3], p1[4], p1[5], p1[6], p1[7], p1[8], p1[9], p1[10],
                                a0, a1, a2, a3, a4, a5, a6, a7],
                    dtype=(tl.float32,) * 8, is_pure=True, pack=1)
            else:
                a0, a1, a2, a3, a4, a5, a6, a7 = tl.inline_asm_elementwise(
                    ASM, CONS, [p0[0], p0[1], p0[2], p0[3], p0[4], p0[5], p0[6], p0[7], p0[8], p0[9], p0[10],
                                a0, a1, a2, a3, a4, a5, a6, a7],
                    dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    # Sum the warps' K slices; lane (g, t) then holds rows g and g + 8 for x rows 2t and 2t + 1.
    lane32 = tl.arange(0, 32)
    n0 = pid_n * 16 + lane32 // 4
    m0 = (lane32 % 4) * 2
    vals = _pairs(_warp_sum(a0, NW), _warp_sum(a1, NW), _warp_sum(a2, NW), _warp_sum(a3, NW))
    offs_m = _pairs(m0, m0 + 1, m0, m0 + 1)
    offs_n = _pairs(n0, n0, n0 + 8, n0 + 8)
    if COLS == 2:
        vals = tl.reshape(tl.join(vals, _pairs(_warp_sum(a4, NW), _warp_sum(a5, NW), _warp_sum(a6, NW),
                                               _warp_sum(a7, NW))), [256])
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
    tiles: int = 1,
    split_k: int = 1,
    prefetch: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] · Wᵀ (+ bias) for M ≤ 16 on the tensor cores; x fp16 (or bf16 with W4)."""
    m, k = x.shape
    if m > 16:
        raise ValueError(f"the mma GEMV takes at most 16 rows of x, got {m}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    n = mw.out_features
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    n_tiles = triton.cdiv(k, TILE_K)
    split_k = clamp_split(max(1, min(split_k, n_tiles)), m, n)
    ws = workspace(split_k, m, n, x.device)
    row_tiles = triton.cdiv(n, 16)
    cnt = counters(x.device, row_tiles)
    cols = 1 if m <= 8 else 2
    bf16 = x.dtype == torch.bfloat16
    if prefetch:
        tiles = 1
    asm, cons = asm_for(mw.bits, cols, tiles, num_warps, bf16, k % TILE_K == 0, prefetch)
    load_asm, load_cons = _load_asm(mw.bits)
    mma_gemv_kernel[(row_tiles, split_k)](
        x.data_ptr(), mw.qweight.data_ptr(), mw.scales, mw.zeros, bias if bias is not None else out, out, ws, cnt,
        m, n, k, mw.qweight.shape[1], mw.scales.shape[1], x.stride(0), out.stride(0), group_size=mw.group_size,
        ASM=asm, CONS=cons, BITS=mw.bits, COLS=cols, TILES=tiles, NW=num_warps, BF16=bf16,
        SPLIT_K=split_k, SPLIT=split_k > 1, HAS_BIAS=bias is not None,
        PREFETCH=prefetch, LOAD_ASM=load_asm, LOAD_CONS=load_cons, num_warps=num_warps,
    )
    return out


def emulate(x: torch.Tensor, mw: MmaWeights) -> torch.Tensor:
    """What the kernel computes, in torch on any device, following its operands (for the CPU tests):
    fp16 pairs 1024 + q from the words, x pairs in the slots the layout assigns, the zero mma, fp32
    sums per group, the scale once per group. Returns fp32 [M, N]."""
    m, k = x.shape
    n = mw.out_features
    kp = -(-k // TILE_K) * TILE_K
    words = mw.qweight.to(torch.int64) & 0xFFFFFFFF
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
