"""The tensor-core GEMV's layout, its dequantize kernel and its inline PTX, on the CPU.

The GEMV itself needs a GPU (inline PTX does not run under TRITON_INTERPRET; bench/kernels_check.py
and bench/lib/kernels_mma.py check it on the H200). Here the PTX that `_asm` generates is executed by a
small interpreter of the instructions it uses, lane by lane, with `mma.sync` done warp-wide from the
fragment layout in the PTX ISA, on words packed by `pack_mma` and addresses computed as the Triton
kernel computes them. That checks the layout, the generator and the address scheme against each other.
"""

from __future__ import annotations

import pytest
import torch
from quantkit_testing.kernel_oracles import emulate_mma_gemv
from quantkit_testing.mma_layers import mma_codes, random_layer
from quantkit_testing.ptx_interp import Warp

from quantkit.kernels import launch as launch_mod
from quantkit.kernels import triton_mma as tm


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [128, 200, 384])
def test_pack_roundtrip(bits, k):
    q = torch.randint(0, 2**bits, (19, k), generator=torch.Generator().manual_seed(k))
    words = tm.pack_mma(q, bits)
    assert words.shape == (4, 16 * -(-k // 128) * 128 * bits // 32)
    assert torch.equal(mma_codes(words, bits, k, 19), q)


def test_w4_word_holds_eight_consecutive_inputs():
    q = torch.arange(128).reshape(1, 128) % 16
    # word 4·t + c covers inputs 32·c + 8·t + 0…7; nibble p holds input offset W4_ORDER[p]
    w = int(tm._row_words(q, 4)[0, 4 * 1 + 2]) & 0xFFFFFFFF
    nibbles = [(w >> (4 * p)) & 0xF for p in range(8)]
    assert nibbles == [(32 * 2 + 8 * 1 + tm.W4_ORDER[p]) % 16 for p in range(8)]


@pytest.mark.parametrize("bits,k,gs", [(4, 256, 128), (4, 320, 128), (8, 384, 384), (4, 384, 256)])
def test_emulate_matches_reference(bits, k, gs):
    mw, _, w, _ = random_layer(24, k, bits, gs, seed=bits + k)
    x = torch.randn(5, k).half()
    ref = x.float() @ w.t()
    err = (emulate_mma_gemv(x, mw) - ref).norm() / ref.norm()
    assert err < 1e-5


@pytest.mark.parametrize("bits,gs", [(4, 128), (4, 256), (8, 160)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tiles", [1, 2])
def test_dequantize_kernel(triton_interpreter, bits, gs, dtype, tiles):
    mw, _, w, _ = random_layer(33, 160 if bits == 8 else 192, bits, gs, seed=7)
    out = tm.dequantize(mw, dtype, tiles=tiles)
    torch.testing.assert_close(out, w.to(dtype), rtol=0, atol=0)


def test_dequantize_row_range_into_a_buffer(triton_interpreter):
    mw, _, w, _ = random_layer(70, 256, 4, 128, seed=11)
    whole = tm.dequantize(mw, torch.float16)
    buf = torch.full((70 - 32, 256), float("nan"), dtype=torch.float16)
    got = tm.dequantize(mw, torch.float16, rows=(32, 70), out=buf)
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(got, whole[32:70], rtol=0, atol=0)
    torch.testing.assert_close(got, w[32:70].half(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiple of 16"):
        tm.dequantize(mw, torch.float16, rows=(8, 40))


def test_supports():
    assert tm.supports(4, 128, 4096, 32, torch.float16)
    assert tm.supports(8, 4096, 4096, 1, torch.float16)
    assert tm.supports(4, 256, 4096, 16, torch.bfloat16)
    assert not tm.supports(8, 4096, 4096, 1, torch.bfloat16)
    assert not tm.supports(4, 64, 4096, 64, torch.float16)


def _store(memory: dict[int, int], base: int, t: torch.Tensor) -> None:
    """Tensor bytes at `base`, as the 32-bit little-endian words the interpreter reads."""
    data = t.contiguous().view(torch.uint8).flatten().tolist()
    data += [0] * (-len(data) % 4)
    for i in range(0, len(data), 4):
        memory[base + i] = data[i] | data[i + 1] << 8 | data[i + 2] << 16 | data[i + 3] << 24


@pytest.mark.parametrize("bits,m,tiles,k,bf16,rows", [
    (4, 1, 1, 128, False, 1), (4, 3, 2, 256, False, 1), (4, 11, 1, 128, False, 1), (8, 5, 2, 256, False, 1),
    (4, 2, 1, 96, False, 1), (4, 4, 2, 256, True, 1), (8, 16, 1, 128, False, 1), (4, 13, 2, 256, False, 1),
    (4, 30, 1, 96, False, 1), (4, 20, 1, 128, True, 1), (8, 64, 1, 128, False, 1), (8, 6, 2, 200, False, 1),
    (4, 1, 1, 128, False, 2), (4, 16, 2, 256, False, 4), (8, 9, 1, 200, False, 2), (4, 37, 1, 128, True, 2),
    (8, 33, 2, 256, False, 4), (4, 64, 1, 96, False, 2),
])
def test_generated_ptx_computes_the_tile(bits, m, tiles, k, bf16, rows):
    """The asm of one warp, with inputs as the kernel's _tile_ops() computes them for warp 0 of a
    one-warp program (tiles 0, 1, …), gives x · Wᵀ over those tiles, for 1 to 8 column tiles of x and
    1, 2 or 4 row tiles. The last row tile is partly past N (its rows are zero padding, scales 0)."""
    n, gs = 16 * rows - 5, 128
    mw, _, w, _ = random_layer(n, k, bits, gs, seed=m + rows)
    dtype = torch.bfloat16 if bf16 else torch.float16
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    cols = 1 << max(0, (-(-m // 8) - 1).bit_length())
    even_k = k % 128 == 0
    asm, cons = tm.asm_for(bits, cols, bf16, even_k, tiles, rows)
    outs = 4 * cols * rows
    assert len(cons.split(",")) == outs + (3 + 4 * rows) * tiles + 3 + outs
    # memory: words at 0x100000, x (padded with NaN past K and past M: never read) at 0x800000
    memory: dict[int, int] = {}
    wbase, xbase = 0x100000, 0x800000
    _store(memory, wbase, mw.qweight)
    kp = -(-k // 128) * 128
    xpad = torch.full((m, kp + 8), float("nan"), dtype=dtype)
    xpad[:, :k] = x
    _store(memory, xbase, xpad)
    row_bytes = (kp + 8) * 2
    wpt = 4 if bits == 4 else 8
    s_pad = torch.zeros(16 * rows, mw.scales.shape[1], dtype=torch.float16)
    s_pad[:n] = mw.scales  # the kernel masks the scale loads of rows past N to 0
    z_pad = torch.zeros(16 * rows, mw.zeros.shape[1], dtype=torch.uint8)
    z_pad[:n] = mw.zeros
    lanes = []
    for lane in range(32):
        g, t = divmod(lane, 4)
        ins = []
        for tile in range(tiles):
            gi = tile * 128 // gs
            ins += [wbase + lane * 16 + tile * wpt * 256, xbase + min(g, m - 1) * row_bytes + t * 16 + tile * 256,
                    k - tile * 128 - t * 8]  # block (0, tile), x, inputs left
            for r in range(rows):
                ins += [int(s_pad[16 * r + g, gi].view(torch.int16)) & 0xFFFF,
                        int(s_pad[16 * r + g + 8, gi].view(torch.int16)) & 0xFFFF,
                        int(z_pad[16 * r + g, gi]), int(z_pad[16 * r + g + 8, gi])]
        ins += [mw.qweight.shape[1] * 4, 8 * row_bytes, m - g]
        ins += [0.0] * outs
        lanes.append(ins)
    out = Warp(asm, lanes, memory, bf16, first_input=outs).run()
    ref = x.float()[:, : tiles * 128] @ w[:, : tiles * 128].t()
    got = torch.zeros(m, 16 * rows)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for r in range(rows):
            for nt in range(cols):
                for i, (row, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
                    if col + 8 * nt < m:
                        got[col + 8 * nt, 16 * r + row] = out[lane][4 * (cols * r + nt) + i]
    torch.testing.assert_close(got[:, :n], ref, rtol=2e-3, atol=2e-3)
    assert torch.all(got[:, n:] == 0)


@pytest.mark.parametrize("bits", [4, 8])
def test_blocks_place_each_threads_words(bits):
    q = torch.randint(0, 2**bits, (24, 384), generator=torch.Generator().manual_seed(5))
    rows = tm._row_words(q, bits)
    wpt = 4 if bits == 4 else 8
    b = tm.pack_mma(q, bits)
    assert b.shape == (4, 3 * 64 * wpt)
    for r, tile, h, v, g, t in [(0, 0, 0, 0, 0, 0), (1, 2, 0, wpt // 4 - 1, 5, 3), (0, 1, 1, 0, 7, 2)]:
        block = b[r, tile * 64 * wpt:(tile + 1) * 64 * wpt].reshape(2, wpt // 4, 32, 4)
        row = 16 * r + 8 * h + g
        assert torch.equal(block[h, v, 4 * g + t], rows[row, tile * 4 * wpt + t * wpt + 4 * v:][:4])
    assert torch.all(b[1, : 64 * wpt].reshape(2, wpt // 4, 32, 4)[1] == 0)  # rows 24…31 past N are zero


def _reference(x, w, bias):
    y = x.float() @ w.t()
    return y if bias is None else y + bias.float()


@pytest.mark.parametrize("bits,m,k,n,bf16,warps,tiles,rows,warps_n,split_k,pdl,bias", [
    (4, 1, 256, 40, False, 2, 1, 1, 1, 1, False, True),     # two warps split K, rows past N
    (4, 5, 200, 40, False, 2, 2, 2, 1, 1, True, False),     # odd K, 2 row tiles per warp, PDL path
    (8, 13, 384, 24, False, 4, 1, 1, 2, 2, False, True),    # row groups, split-K across programs
    (4, 9, 256, 70, True, 2, 1, 4, 2, 1, False, False),     # bf16, 4 row tiles, a row group past the buffer
    (4, 33, 128, 16, False, 1, 1, 1, 1, 1, False, True),    # 8 column tiles
    (8, 3, 640, 33, False, 2, 2, 1, 1, 3, True, False),     # split-K 3 over 5 K-tiles (last slice short)
    (4, 2, 256, 40, False, 4, 1, 2, 4, 1, False, False),    # row groups 2 and 3 wholly past the words
])
def test_gemv_kernel_under_the_interpreter(mma_asm, bits, m, k, n, bf16, warps, tiles, rows, warps_n, split_k, pdl,
                                           bias):
    """The whole Triton kernel (operands, row groups, split-K workspace, masks, stores) on the CPU: the
    interpreter runs its Python and tests/support/quantkit_testing/ptx_interp.py its inline PTX, on NaN-poisoned outputs."""
    gs = 128
    mw, _, w, _ = random_layer(n, k, bits, gs, seed=m * 7 + n)
    dtype = torch.bfloat16 if bf16 else torch.float16
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    mma_asm(x, mw.qweight)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    tm.gemv(x, mw, b, num_warps=warps, tiles=tiles, rows=rows, warps_n=warps_n, split_k=split_k, pdl=pdl,
            prefetch=1 if pdl else 0, out=out)
    ref = _reference(x, w, b)
    assert torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()) < 1e-2


def test_dispatch_runs_64_row_slices(mma_asm):
    """dispatch.run with an mma choice launches the GEMV once per 64 rows of x (bias added once)."""
    from quantkit.kernels import dispatch

    mw, _, w, _ = random_layer(24, 128, 4, 128, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(70, 128, generator=g).half()
    b = torch.randn(24, generator=g).half()
    mma_asm(x, mw.qweight)
    choice = dispatch.Choice("mma", dict(num_warps=1, tiles=1))
    out = dispatch.run(x, mw, b, choice)
    ref = _reference(x, w, b)
    assert out.shape == (70, 24)
    assert ((out.float() - ref).norm() / ref.norm()) < 1e-2


class _FakeCompiled:
    """Stands in for Triton's compiled kernel: records what the fast path hands its launcher."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class _FakeDriver:
    class active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 1234


def test_gemv_launch_hands_the_kernel_its_arguments_in_order(mma_asm, monkeypatch):
    """After the first call (the interpreter has no compiled kernel to keep, so one is injected), a
    GemvLaunch passes the compiled kernel every argument in the kernel's parameter order with this
    call's x and output; a call whose specialization differs (an output row stride not ≡ the first
    one's modulo 16) goes through Triton's front end again and still computes the product."""
    mw, _, w, _ = random_layer(40, 256, 4, 128, seed=5)
    g = torch.Generator().manual_seed(5)
    x1, x2 = (torch.randn(3, 256, generator=g).half() for _ in range(2))
    mma_asm(x1, mw.qweight)
    launch = tm.GemvLaunch(mw, None, 3, x1.device, num_warps=2, tiles=2)
    first = launch(x1)
    assert launch.compiled is None  # the interpreter returns no compiled kernel
    fake = _FakeCompiled()
    launch.compiled, launch.specialized = fake, (first.data_ptr() % 16, 256 % 16, 40 % 16)
    monkeypatch.setattr(launch_mod, "driver", _FakeDriver)
    out = launch(x2)
    (g0, g1, g2, stream, fn, meta, _, _, _, *args), = fake.calls
    assert (g0, g1, g2, stream, fn, meta) == (3, 1, 1, 1234, "function", "metadata")  # 16-row programs
    assert len(args) == len(tm.mma_gemv_kernel.arg_names)
    bound = dict(zip(tm.mma_gemv_kernel.arg_names, args))
    assert bound["x_addr"] == x2.data_ptr() and bound["out_ptr"] is out and bound["bias_ptr"] is out
    assert bound["w_addr"] == mw.qweight.data_ptr() and bound["s_ptr"] is mw.scales and bound["z_ptr"] is mw.zeros
    assert (bound["M"], bound["N"], bound["K"], bound["stride_xm"], bound["stride_om"]) == (3, 40, 256, 256, 40)
    assert (bound["ASM"], bound["CONS"]) == tm.asm_for(4, 1, False, True, 2, 1)
    assert (bound["TILES"], bound["NW"], bound["HAS_BIAS"], bound["PDL"]) == (2, 2, False, False)
    mma_asm(x2, mw.qweight)
    wide = torch.full((3, 41), float("nan"), dtype=torch.float16)[:, :40]
    launch(x2, wide)
    assert len(fake.calls) == 1
    with pytest.raises(ValueError, match="set up for torch.float16"):
        launch(x2.bfloat16())
    ref = x2.float() @ w.t()
    assert ((wide.float() - ref).norm() / ref.norm()) < 1e-2
    torch.testing.assert_close(first.float(), x1.float() @ w.t(), rtol=2e-2, atol=2e-2)


def test_dispatch_keeps_one_launch_per_layer_and_m():
    from quantkit.kernels import dispatch

    mw, _, _, _ = random_layer(40, 256, 4, 128, seed=6)
    cpu = torch.device("cpu")
    a = dispatch.gemv_launch(mw, None, 3, torch.float16, cpu)
    assert isinstance(a, tm.GemvLaunch) and a.m == 3
    assert dispatch.gemv_launch(mw, None, 3, torch.float16, cpu) is a
    assert dispatch.gemv_launch(mw, None, 5, torch.float16, cpu) is not a
    bias = torch.zeros(40, dtype=torch.float16)
    b = dispatch.gemv_launch(mw, bias, 3, torch.float16, cpu)
    assert b is not a and b.bias is bias
    assert dispatch.gemv_launch(mw, None, 65, torch.float16, cpu) is None  # dequantize + cuBLAS
    w8, _, _, _ = random_layer(40, 256, 8, 256, seed=7)
    assert dispatch.gemv_launch(w8, None, 3, torch.bfloat16, cpu) is None  # not taken by the mma GEMV


def test_dispatch_run_keeps_the_launch_of_an_mma_choice(mma_asm):
    from quantkit.kernels import dispatch

    mw, _, w, _ = random_layer(24, 128, 4, 128, seed=8)
    g = torch.Generator().manual_seed(9)
    choice = dispatch.Choice("mma", dict(num_warps=1, tiles=1))
    for _ in range(2):
        x = torch.randn(5, 128, generator=g).half()
        mma_asm(x, mw.qweight)
        out = dispatch.run(x, mw, None, choice)
        ref = x.float() @ w.t()
        assert ((out.float() - ref).norm() / ref.norm()) < 1e-2
    assert list(mw.launches) == [(5, torch.float16, (("num_warps", 1), ("tiles", 1)))]


def test_gemv_launch_falls_back_when_the_launcher_refuses(mma_asm, monkeypatch):
    mw, _, w, _ = random_layer(24, 128, 4, 128, seed=12)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(12)).half()
    mma_asm(x, mw.qweight)
    launch = tm.GemvLaunch(mw, None, 2, x.device, num_warps=1)
    first = launch(x)

    class Refusing(_FakeCompiled):
        def run(self, *args):
            raise TypeError("another calling convention")

    launch.compiled, launch.specialized = Refusing(), (first.data_ptr() % 16, 128 % 16, 24 % 16)
    monkeypatch.setattr(launch_mod, "driver", _FakeDriver)
    out = launch(x)
    assert not launch.direct and launch.compiled is None
    torch.testing.assert_close(out, first, rtol=0, atol=0)
