"""The tensor-core GEMV's layout, its dequantize kernel and its inline PTX, on the CPU.

The GEMV itself needs a GPU (inline PTX does not run under TRITON_INTERPRET; bench/kernels_check.py
and bench/kernels_mma.py check it on the H200). Here the PTX that `_asm` generates is executed by a
small interpreter of the instructions it uses, lane by lane, with `mma.sync` done warp-wide from the
fragment layout in the PTX ISA, on words packed by `pack_mma` and addresses computed as the Triton
kernel computes them. That checks the layout, the generator and the address scheme against each other.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from quantkit.kernels import triton_mma as tm
from quantkit.kernels.triton_layout import KernelWeights, pack_block_planar


def random_layer(n: int, k: int, bits: int, gs: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=g)
    groups = -(-k // gs)
    s = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).half()
    z = torch.randint(0, 2**bits, (n, groups), generator=g).to(torch.uint8)
    kw = KernelWeights(pack_block_planar(q, bits), s, z, bits, gs, k, n)
    idx = torch.arange(k) // gs
    w = (q.float() - z.float()[:, idx]) * s.float()[:, idx]
    return tm.from_kernel_weights(kw), q, w


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [128, 200, 384])
def test_pack_roundtrip(bits, k):
    q = torch.randint(0, 2**bits, (19, k), generator=torch.Generator().manual_seed(k))
    words = tm.pack_mma(q, bits)
    assert words.shape == (19, -(-k // 128) * 128 * bits // 32)
    assert torch.equal(tm.unpack_mma(words, bits, k), q)


def test_w4_word_holds_eight_consecutive_inputs():
    q = torch.arange(128).reshape(1, 128) % 16
    words = tm.pack_mma(q, 4)
    # word 4·t + c covers inputs 32·c + 8·t + 0…7; nibble p holds input offset W4_ORDER[p]
    w = int(words[0, 4 * 1 + 2]) & 0xFFFFFFFF
    nibbles = [(w >> (4 * p)) & 0xF for p in range(8)]
    assert nibbles == [(32 * 2 + 8 * 1 + tm.W4_ORDER[p]) % 16 for p in range(8)]


@pytest.mark.parametrize("bits,k,gs", [(4, 256, 128), (4, 320, 128), (8, 384, 384), (4, 384, 256)])
def test_emulate_matches_reference(bits, k, gs):
    mw, _, w = random_layer(24, k, bits, gs, seed=bits + k)
    x = torch.randn(5, k).half()
    ref = x.float() @ w.t()
    err = (tm.emulate(x, mw) - ref).norm() / ref.norm()
    assert err < 1e-5


@pytest.mark.parametrize("bits,gs", [(4, 128), (4, 256), (8, 160)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_kernel(triton_interpreter, bits, gs, dtype):
    mw, _, w = random_layer(33, 160 if bits == 8 else 192, bits, gs, seed=7)
    out = tm.dequantize(mw, dtype, block_n=16, tiles=1)
    torch.testing.assert_close(out, w.to(dtype), rtol=0, atol=0)


def test_supports():
    assert tm.supports(4, 128, 4096, 32, torch.float16)
    assert tm.supports(8, 4096, 4096, 1, torch.float16)
    assert tm.supports(4, 256, 4096, 16, torch.bfloat16)
    assert not tm.supports(8, 4096, 4096, 1, torch.bfloat16)
    assert not tm.supports(4, 64, 4096, 64, torch.float16)


# --- a warp-level interpreter for the generated PTX -------------------------------------------------

def _h2f(bits: int, bf16: bool) -> float:
    if bf16:
        return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


def _prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def run_warp(asm: str, lane_inputs: list[list], memory: dict[int, int], bf16: bool) -> list[list[float]]:
    """Execute `asm` for 32 lanes; lane_inputs[l] are the values of $8, $9, … (after 8 outputs)."""
    regs = [dict() for _ in range(32)]
    for lane in range(32):
        for i, v in enumerate(lane_inputs[lane]):
            regs[lane][f"${8 + i}"] = v

    def val(lane, tok):
        tok = tok.strip()
        if tok in regs[lane]:
            return regs[lane][tok]
        if tok.startswith("0f"):
            return float(np.array([int(tok[2:], 16)], dtype=np.uint32).view(np.float32)[0])
        return int(tok, 0)

    body = [ln.strip().rstrip(";") for ln in asm.splitlines()]
    for line in body:
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        if line.startswith("mma.sync"):
            groups = re.findall(r"\{([^}]*)\}", line)
            d, a, b, c = ([t.strip() for t in grp.split(",")] for grp in groups)
            A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
            for lane in range(32):
                g, t = divmod(lane, 4)
                av = [val(lane, r) for r in a]
                for r, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
                    A[row, col] = _h2f(av[r] & 0xFFFF, bf16)
                    A[row, col + 1] = _h2f(av[r] >> 16, bf16)
                bv = [val(lane, r) for r in b]
                for r, row in enumerate([2 * t, 2 * t + 8]):
                    B[row, g] = _h2f(bv[r] & 0xFFFF, bf16)
                    B[row + 1, g] = _h2f(bv[r] >> 16, bf16)
                for r, (row, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
                    C[row, col] = val(lane, c[r])
            D = (A @ B + C).astype(np.float32)
            for lane in range(32):
                g, t = divmod(lane, 4)
                for r, (row, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
                    regs[lane][d[r]] = float(D[row, col])
            continue
        pred = None
        if line.startswith("@"):
            pred, line = line[1:].split(" ", 1)
        op, rest = line.split(" ", 1)
        for lane in range(32):
            r = regs[lane]
            if pred is not None and not r[pred]:
                continue
            if op.startswith("ld.global"):
                dst, addr, off = re.match(r"\{([^}]*)\},\s*\[([^+\]]+)\+(\d+)\]", rest).groups()
                base = val(lane, addr) + int(off)
                for i, name in enumerate(dst.split(",")):
                    r[name.strip()] = memory[base + 4 * i]
                continue
            args = [a.strip() for a in rest.split(",")]
            if op in ("mov.b32", "mov.f32"):
                r[args[0]] = val(lane, args[1])
            elif op == "sub.s32":
                r[args[0]] = val(lane, args[1]) - val(lane, args[2])
            elif op == "setp.gt.s32":
                r[args[0]] = val(lane, args[1]) > val(lane, args[2])
            elif op == "shr.b32":
                r[args[0]] = (val(lane, args[1]) & 0xFFFFFFFF) >> val(lane, args[2])
            elif op == "shl.b32":
                r[args[0]] = (val(lane, args[1]) << val(lane, args[2])) & 0xFFFFFFFF
            elif op == "or.b32":
                r[args[0]] = (val(lane, args[1]) | val(lane, args[2])) & 0xFFFFFFFF
            elif op == "lop3.b32":
                assert args[4] == "0xEA"  # (a & b) | c
                r[args[0]] = ((val(lane, args[1]) & val(lane, args[2])) | val(lane, args[3])) & 0xFFFFFFFF
            elif op == "prmt.b32":
                r[args[0]] = _prmt(val(lane, args[1]) & 0xFFFFFFFF, val(lane, args[2]) & 0xFFFFFFFF, val(lane, args[3]))
            elif op == "cvt.f32.f16":
                r[args[0]] = _h2f(val(lane, args[1]), False)
            elif op == "fma.rn.f32":
                r[args[0]] = float(np.float32(val(lane, args[1])) * np.float32(val(lane, args[2]))
                                   + np.float32(val(lane, args[3])))
            else:
                raise AssertionError(f"interpreter lacks {op}")
    return [[regs[lane][f"${i}"] for i in range(8)] for lane in range(32)]


@pytest.mark.parametrize("bits,m,tiles,k,bf16", [
    (4, 1, 1, 128, False), (4, 3, 2, 256, False), (4, 11, 1, 128, False), (8, 5, 2, 256, False),
    (4, 2, 1, 96, False), (4, 4, 2, 256, True), (8, 16, 1, 128, False),
])
def test_generated_ptx_computes_the_tile(bits, m, tiles, k, bf16):
    n, gs = 16, 128
    mw, _, w = random_layer(n, k, bits, gs, seed=m)
    dtype = torch.bfloat16 if bf16 else torch.float16
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    cols = 1 if m <= 8 else 2
    even_k = k % 128 == 0
    asm, cons = tm.asm_for(bits, cols, bf16, even_k, tiles)
    assert len(cons.split(",")) == 8 + 9 * tiles + 8
    # memory: words at 0x100000, x (padded with garbage past K, never read when K is odd) at 0x800000
    memory: dict[int, int] = {}
    wbase, xbase = 0x100000, 0x800000
    kw_words = mw.qweight.shape[1]
    for i, v in enumerate(mw.qweight.flatten().tolist()):
        memory[wbase + 4 * i] = v & 0xFFFFFFFF
    kp = -(-k // 128) * 128
    xbits = x.view(torch.int16).to(torch.int32) & 0xFFFF
    xpad = torch.full((m, kp + 8), 0x7E00, dtype=torch.int32)  # NaN past K: must not be read
    xpad[:, :k] = xbits
    for row in range(m):
        for j in range(0, kp + 8, 2):
            memory[xbase + (row * (kp + 8) + j) * 2] = int(xpad[row, j]) | (int(xpad[row, j + 1]) << 16)
    wpt = 4 if bits == 4 else 8
    lanes = []
    for lane in range(32):
        g, t = divmod(lane, 4)
        ins = []
        for u in range(tiles):  # the kernel's _tile(), warp 0 of a one-warp program
            tile = u
            gi = tile * 128 // gs
            ins += [wbase + g * kw_words * 4 + t * wpt * 4 + tile * wpt * 16,
                    wbase + (g + 8) * kw_words * 4 + t * wpt * 4 + tile * wpt * 16,
                    xbase + min(g, m - 1) * (kp + 8) * 2 + t * 16 + tile * 256,
                    xbase + min(g + 8, m - 1) * (kp + 8) * 2 + t * 16 + tile * 256,
                    k - tile * 128 - t * 8,
                    int(mw.scales[g, gi].view(torch.int16)) & 0xFFFF,
                    int(mw.scales[g + 8, gi].view(torch.int16)) & 0xFFFF,
                    int(mw.zeros[g, gi]), int(mw.zeros[g + 8, gi])]
        ins += [0.0] * 8
        lanes.append(ins)
    out = run_warp(asm, lanes, memory, bf16)
    ref = x.float() @ w[:, : tiles * 128].t() if k >= tiles * 128 else x.float() @ w.t()
    got = torch.zeros(m, n)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for nt in range(cols):
            for i, (row, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
                if col + 8 * nt < m:
                    got[col + 8 * nt, row] = out[lane][4 * nt + i]
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)
