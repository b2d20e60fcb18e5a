"""Torch oracles of the GPU kernels' arithmetic, step for step, for the CPU tests: what the mma GEMV
(quantkit/kernels/triton_mma.py) and the Gluon GEMM (quantkit/kernels/gluon_gemm.py) compute from the
mma layout's words, and the Gluon GEMM's permutation of x."""

from __future__ import annotations

import torch

from quantkit.formats.awq_gemm import pack_awq_gemm
from quantkit.formats.compressed_tensors import pack_compressed
from quantkit.kernels import reference, triton_layout
from quantkit.kernels.triton_mma import PAIR_NIBBLE, TILE_K, W4_ORDER, MmaWeights


def row_words(blocks: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The mma layout's words [row tiles, blocks] back in row order [n, K-tiles · 4 · wpt] (the inverse of
    triton_mma._blocks: each row's words of each K-tile, as triton_mma._row_words made them)."""
    wpt = 4 if bits == 4 else 8
    rt, per = blocks.shape
    kt = per // (64 * wpt)
    w = blocks.reshape(rt, kt, 2, wpt // 4, 8, 4, 4).permute(0, 2, 4, 1, 5, 3, 6)  # [r, half, g, T, t, v, i]
    return w.reshape(rt * 16, kt * 4 * wpt)[:n]


def emulate_mma_gemv(x: torch.Tensor, mw: MmaWeights) -> torch.Tensor:
    """What the mma GEMV computes, in torch on any device, following its operands:
    fp16 pairs 1024 + q from the words, x pairs in the slots the layout assigns, the offset and zero
    point off, fp32 sums per group, the scale once per group. Returns fp32 [M, N]."""
    m, k = x.shape
    assert k == mw.in_features, (k, mw.in_features)  # a shorter x would be zero-padded silently
    n = mw.out_features
    kp = -(-k // TILE_K) * TILE_K
    words = row_words(mw.qweight, mw.bits, n).to(torch.int64) & 0xFFFFFFFF
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
    groups = torch.div(torch.arange(kp, device=x.device), mw.group_size, rounding_mode="floor")
    groups = groups.clamp(max=mw.scales.shape[1] - 1)
    z = mw.zeros.to(torch.float32)[:, groups] + 1024.0
    s = mw.scales.to(torch.float32)
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    for gi in range(mw.scales.shape[1]):
        sel = groups == gi
        part = xs[:, sel] @ (a[:, sel] - z[:, sel]).t()
        out += part * s[:, gi]
    return out


def permute_x_torch(x: torch.Tensor) -> torch.Tensor:
    """What `gluon_gemm.permute_x` computes, in torch: input bits (high to low) c1 c0
    t1 t0 h i e of each 128-input tile → dot order c1 c0 h i t1 t0 e."""
    m, k = x.shape
    kt = -(-k // TILE_K)
    xp = torch.zeros(m, kt * TILE_K, dtype=x.dtype, device=x.device)
    xp[:, :k] = x
    return xp.reshape(m, kt, 4, 4, 2, 2, 2).permute(0, 1, 2, 4, 5, 3, 6).reshape(m, kt * TILE_K)


def emulate_gluon_gemm(x: torch.Tensor, mw: MmaWeights) -> torch.Tensor:
    """What the Gluon GEMM computes, in torch, step for step: each word's values in input
    order, dequantized as DEQ_ASM / DEQ8_ASM do ((q − z) · s rounded to fp16 once), relabelled by the
    kernel's join / reshape / permute into the dot order, times x permuted into that order; fp32 [M, N]."""
    k = x.shape[1]
    n = mw.out_features
    kt = -(-k // TILE_K)
    per = TILE_K * mw.bits // 32  # words per row and K-tile
    words = (row_words(mw.qweight, mw.bits, n).to(torch.int64) & 0xFFFFFFFF).reshape(n, kt, per)
    gi = torch.clamp(torch.arange(kt, device=x.device) * TILE_K // mw.group_size, max=mw.scales.shape[1] - 1)
    z = mw.zeros.to(torch.float32)[:, gi][:, :, None]
    s = mw.scales.to(torch.float32)[:, gi][:, :, None]

    def join(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.stack([a, b], -1)

    def values(w: torch.Tensor) -> list[torch.Tensor]:  # each word's values in input-offset order
        if mw.bits == 4:
            return [((((w >> (4 * W4_ORDER.index(o))) & 15).to(torch.float32) - z) * s).half() for o in range(8)]
        return [((((w >> (8 * b)) & 255).to(torch.float32) - z) * s).half() for b in range(4)]

    def relabel(q: list[torch.Tensor]) -> torch.Tensor:
        if mw.bits == 4:
            return join(join(join(q[0], q[1]), join(q[2], q[3])), join(join(q[4], q[5]), join(q[6], q[7])))
        return join(join(q[0], q[1]), join(q[2], q[3]))

    v = relabel(values(words))  # W4: [N, KT, 16 words, e, i, h]; W8: [N, KT, 32 words, byte bit 0, byte bit 1]
    if mw.bits == 4:
        v = v.reshape(n, kt, 2, 2, 2, 2, 2, 2, 2).permute(0, 1, 4, 5, 8, 7, 2, 3, 6)  # as the kernel, per K-tile
    else:
        v = v.reshape(n, kt, 4, 4, 2, 2, 2).permute(0, 1, 3, 4, 6, 2, 5)  # as the kernel, per K-tile
    a = v.reshape(n, kt * TILE_K).float()
    return permute_x_torch(x).float() @ a.t()


def packed_layer(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, bits: int, gsz: int, fmt: str,
                 symmetric: bool):
    """Integers, zeros and scales packed in an on-disk format ("awq" or compressed-tensors), then into the
    block-planar kernel layout: (KernelWeights, the dequantized weight [n, k] the reference reads back)."""
    n, k = q.shape
    if fmt == "awq":
        t = pack_awq_gemm(q, z, s)
        kw = triton_layout.from_awq(t["qweight"], t["qzeros"], t["scales"], gsz)
        w = reference.dequantize_awq(t["qweight"], t["qzeros"], t["scales"], gsz)
    else:
        t = pack_compressed(q, z, s, bits, symmetric)
        zp = t.get("weight_zero_point")
        kw = triton_layout.from_packed(t["weight_packed"], t["weight_scale"], zp, n, k, bits, gsz)
        w = reference.dequantize_packed(t["weight_packed"], t["weight_scale"], zp, n, k, bits, gsz)
    return kw, w
