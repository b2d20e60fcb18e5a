"""The tensor-core GEMV's layout, its dequantize kernel and its inline PTX, on the CPU.

The GEMV itself needs a GPU (inline PTX does not run under TRITON_INTERPRET; bench/kernels_check.py
and bench/kernels_mma.py check it on the H200). Here the PTX that `_asm` generates is executed by a
small interpreter of the instructions it uses, lane by lane, with `mma.sync` done warp-wide from the
fragment layout in the PTX ISA, on words packed by `pack_mma` and addresses computed as the Triton
kernel computes them. That checks the layout, the generator and the address scheme against each other.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import triton_mma as tm
from quantkit.kernels.triton_layout import KernelWeights, pack_block_planar
from ptx_interp import Cta


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


@pytest.mark.parametrize("bits,m,tiles,k,bf16,blocked", [
    (4, 1, 1, 128, False, False), (4, 3, 2, 256, False, False), (4, 11, 1, 128, False, False),
    (8, 5, 2, 256, False, False), (4, 2, 1, 96, False, False), (4, 4, 2, 256, True, False),
    (8, 16, 1, 128, False, False), (4, 3, 2, 256, False, True), (8, 9, 2, 256, False, True),
])
def test_generated_ptx_computes_the_tile(bits, m, tiles, k, bf16, blocked):
    n, gs = 16, 128
    mw, _, w = random_layer(n, k, bits, gs, seed=m)
    dtype = torch.bfloat16 if bf16 else torch.float16
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    cols = 1 if m <= 8 else 2
    even_k = k % 128 == 0
    asm, cons = tm.asm_for(bits, cols, bf16, even_k, tiles, blocked)
    assert len(cons.split(",")) == 8 + 9 * tiles + 8
    # memory: words at 0x100000, x (padded with garbage past K, never read when K is odd) at 0x800000
    memory: dict[int, int] = {}
    wbase, xbase = 0x100000, 0x800000
    kw_words = mw.qweight.shape[1]
    words = tm.pack_blocked(mw.qweight, bits) if blocked else mw.qweight
    for i, v in enumerate(words.flatten().tolist()):
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
            if blocked:
                wa = wbase + lane * 16 + tile * wpt * 256
                ins += [wa, wa + wpt * 128]
            else:
                ins += [wbase + g * kw_words * 4 + t * wpt * 4 + tile * wpt * 16,
                        wbase + (g + 8) * kw_words * 4 + t * wpt * 4 + tile * wpt * 16]
            ins += [xbase + min(g, m - 1) * (kp + 8) * 2 + t * 16 + tile * 256,
                    xbase + min(g + 8, m - 1) * (kp + 8) * 2 + t * 16 + tile * 256,
                    k - tile * 128 - t * 8,
                    int(mw.scales[g, gi].view(torch.int16)) & 0xFFFF,
                    int(mw.scales[g + 8, gi].view(torch.int16)) & 0xFFFF,
                    int(mw.zeros[g, gi]), int(mw.zeros[g + 8, gi])]
        ins += [0.0] * 8
        lanes.append(ins)
    out = Cta(asm, lanes, memory, bf16).run()
    ref = x.float() @ w[:, : tiles * 128].t() if k >= tiles * 128 else x.float() @ w.t()
    got = torch.zeros(m, n)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for nt in range(cols):
            for i, (row, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
                if col + 8 * nt < m:
                    got[col + 8 * nt, row] = out[lane][4 * nt + i]
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)


def _store(memory: dict[int, int], base: int, t: torch.Tensor) -> None:
    """Tensor bytes at `base`, as the 32-bit little-endian words the interpreter reads."""
    data = t.contiguous().view(torch.uint8).flatten().tolist()
    data += [0] * (-len(data) % 4)
    for i in range(0, len(data), 4):
        memory[base + i] = data[i] | data[i + 1] << 8 | data[i + 2] << 16 | data[i + 3] << 24


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_blocked_places_each_threads_words(bits):
    mw, _, _ = random_layer(24, 384, bits, 128, seed=5)
    wpt = 4 if bits == 4 else 8
    b = tm.pack_blocked(mw.qweight, bits)
    assert b.shape == (2, 3 * 64 * wpt)
    for r, tile, h, v, g, t in [(0, 0, 0, 0, 0, 0), (1, 2, 0, wpt // 4 - 1, 5, 3), (0, 1, 1, 0, 7, 2)]:
        block = b[r, tile * 64 * wpt:(tile + 1) * 64 * wpt].reshape(2, wpt // 4, 32, 4)
        row = 16 * r + 8 * h + g
        assert torch.equal(block[h, v, 4 * g + t], mw.qweight[row, tile * 4 * wpt + t * wpt + 4 * v:][:4])
    assert torch.all(b[1, : 64 * wpt].reshape(2, wpt // 4, 32, 4)[1] == 0)  # rows 24…31 past N are zero


def test_pack_sz_entries():
    mw, _, _ = random_layer(24, 384, 4, 128, seed=3)
    sz = tm.pack_sz(mw)
    assert sz.shape == (2, 3, 8, 4) and sz.dtype == torch.int16
    # row tile 1, tile 2, g = 5: rows 21 and 29 (past N = 24: zero)
    assert sz[1, 2, 5, 0] == mw.scales[21, 2].view(torch.int16)
    assert sz[1, 2, 5, 2] == int(mw.zeros[21, 2])
    assert sz[1, 2, 5, 1] == 0 and sz[1, 2, 5, 3] == 0
    per_channel, _, _ = random_layer(16, 256, 8, 256, seed=4)
    assert torch.equal(tm.pack_sz(per_channel)[0, 0], tm.pack_sz(per_channel)[0, 1])


@pytest.mark.parametrize("bits,m,k,bf16,stages,warps,n,pid,blocked", [
    (4, 1, 1152, False, 3, 2, 16, 0, False),  # 9 tiles: warps take 5 and 4, the ring wraps
    (4, 1, 1152, False, 2, 2, 16, 0, True),
    (4, 3, 384, False, 2, 2, 32, 1, True),    # second row tile
    (4, 11, 200, False, 2, 2, 24, 1, False),  # two column tiles, odd K, rows past N
    (4, 11, 200, False, 3, 2, 24, 1, True),
    (4, 2, 128, True, 3, 2, 16, 0, True),     # bf16; warp 1 has no tile
    (8, 5, 768, False, 4, 1, 16, 0, False),
    (8, 16, 256, False, 2, 2, 16, 0, False),
    (8, 9, 640, False, 2, 2, 24, 1, True),
])
def test_ring_ptx_computes_the_rows(bits, m, k, bf16, stages, warps, n, pid, blocked):
    """The ring kernel's asm, run for every warp of one program with its inputs computed as
    mma_ring_kernel computes them, gives the program's 16 rows of x · Wᵀ."""
    mw, _, w = random_layer(n, k, bits, 128 if bits == 4 else k, seed=m + k)
    dtype = torch.bfloat16 if bf16 else torch.float16
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    cols = 1 if m <= 8 else 2
    asm, cons = tm.ring_asm_for(bits, cols, bf16, k % 128 == 0, stages, warps, blocked)
    assert len(cons.split(",")) == 8 + 7
    memory: dict[int, int] = {}
    wbase, xbase, szbase = 0x100000, 0x800000, 0xC00000
    words = tm.pack_blocked(mw.qweight, bits) if blocked else mw.qweight
    _store(memory, wbase, words)
    kp = -(-k // 128) * 128
    xpad = torch.full((m, kp + 8), float("nan"), dtype=dtype)  # NaN past K: must not be read
    xpad[:, :k] = x
    _store(memory, xbase, xpad)
    _store(memory, szbase, tm.pack_sz(mw))
    kw_words, wpt, n_tiles = mw.qweight.shape[1], 4 if bits == 4 else 8, kp // 128
    inputs = []
    for e in range(32 * warps):
        warp, lane = divmod(e, 32)
        g, t = divmod(lane, 4)
        row = pid * 16 + g
        if blocked:
            wa = wbase + pid * words.shape[1] * 4 + lane * 16 + warp * wpt * 256
            wa8 = wa + wpt * 128
        else:
            wa = wbase + min(row, n - 1) * kw_words * 4 + t * wpt * 4 + warp * wpt * 16
            wa8 = wbase + min(row + 8, n - 1) * kw_words * 4 + t * wpt * 4 + warp * wpt * 16
        inputs.append([
            wa, wa8,
            xbase + min(g, m - 1) * (kp + 8) * 2 + t * 16 + warp * 256,
            xbase + min(g + 8, m - 1) * (kp + 8) * 2 + t * 16 + warp * 256,
            szbase + ((pid * n_tiles + warp) * 8 + g) * 8,
            max(n_tiles - warp + warps - 1, 0) // warps,
            k - warp * 128 - t * 8,
        ])
    out = Cta(asm, inputs, memory, bf16).run()
    got = torch.full((m, n), float("nan"))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for nt in range(cols):
            for i, (r, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
                if col + 8 * nt < m and pid * 16 + r < n:
                    got[col + 8 * nt, pid * 16 + r] = sum(out[32 * wi + lane][4 * nt + i] for wi in range(warps))
    rows = slice(pid * 16, min(pid * 16 + 16, n))
    ref = x.float() @ w.t()
    torch.testing.assert_close(got[:, rows], ref[:, rows], rtol=2e-3, atol=2e-3)
