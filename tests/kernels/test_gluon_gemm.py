"""The Gluon W4 / W8 GEMM's operand orders (on the CPU: the kernel itself needs a Hopper GPU, where
bench/kernels_check.py runs it; tests/kernels/test_compile_cuda.py compiles it for sm_90 here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quantkit_testing.kernel_oracles import emulate_gluon_gemm, permute_x_torch, row_words
from quantkit_testing.mma_layers import random_layer
from quantkit_testing.ptx_interp import Warp, f2h, h2f

from quantkit.kernels import gluon_gemm, triton_mma


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group_size", [(40, 256, 128), (70, 200, -1), (33, 1024, 256), (16, 136, 128)])
def test_dot_order_product_is_the_layer(n, k, group_size, bits):
    # the words' values relabelled as the kernel does,
    # times x permuted into the same order, is x Wᵀ: a wrong relabelling or permutation pairs weights
    # with the wrong inputs (rel. error ≈ 0.5)
    mw, _, w, g = random_layer(n, k, bits, group_size)
    x = torch.randn(7, k, generator=g).half()
    ref = x.float() @ w.t()
    out = emulate_gluon_gemm(x, mw)
    assert ((out - ref).norm() / ref.norm()).item() < 2e-3


@pytest.mark.parametrize("rows", [64, 128])
def test_w8_slot_view_is_the_row_words(rows):
    # `_words` (W8): a slot holds the TMA box `w_box` row-major ([row tiles, 2, 256] of qweight viewed as
    # [row tiles, K-tiles · 2, 256]); viewed as [rows / 8, 2, 128], reshaped and permuted as the kernel
    # does, it must give each row's 32 words of the K-tile in row-word order (`emulate_gluon_gemm` starts from these)
    mw, _, _, _ = random_layer(3 * rows, 512, 8)
    box = gluon_gemm.w_box(rows, 8)[0] if gluon_gemm.gluon is not None else [rows // 16, 2, 256]
    assert box == [rows // 16, 2, 256]
    words = mw.qweight.view(mw.qweight.shape[0], -1, 256)
    rows_in_order = row_words(mw.qweight, 8, mw.qweight.shape[0] * 16)
    for pid_n, t in ((0, 0), (1, 3), (2, 1)):
        slot = words[pid_n * box[0]:(pid_n + 1) * box[0], 2 * t:2 * t + 2, :]  # the box at the kernel's coordinates
        w = slot.reshape(rows // 8, 2, 128).reshape(rows // 16, 2, 2, 8, 4, 4).permute(0, 1, 3, 4, 2, 5)
        w = w.reshape(rows, 32)
        assert torch.equal(w, rows_in_order[pid_n * rows:(pid_n + 1) * rows, 32 * t:32 * t + 32])


@pytest.mark.parametrize("m,k", [(1, 128), (5, 200), (3, 384), (2, 4096)])
def test_permute_x_kernel_matches_torch(triton_interpreter, m, k):
    g = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=g).half()
    xp = gluon_gemm.permute_x(x)
    assert xp.shape == (m, -(-k // 128) * 128)
    assert torch.equal(xp, permute_x_torch(x))
    natural = permute_x_torch(torch.arange(xp.shape[1], dtype=torch.float32)[None, :])[0]
    assert not xp[:, natural >= k].any()  # the padding is zero, not whatever torch.empty held


def test_permute_x_of_a_strided_view(triton_interpreter):
    g = torch.Generator().manual_seed(1)
    big = torch.randn(4, 300, generator=g).half()
    x = big[:, 22:278]  # rows 300 apart, offset by 44 bytes
    assert torch.equal(gluon_gemm.permute_x(x), permute_x_torch(x.contiguous()))
    odd = torch.randn(1 + 3 * 256, generator=g).half()[1:].view(3, 256)  # contiguous, 2 bytes off
    assert torch.equal(gluon_gemm.permute_x(odd), permute_x_torch(odd))


def test_aligned_copies_only_when_needed():
    x = torch.zeros(4, 256, dtype=torch.float16)
    assert gluon_gemm._aligned(x, 16) is x
    odd = torch.zeros(1 + 4 * 256, dtype=torch.float16)[1:].view(4, 256)
    fixed = gluon_gemm._aligned(odd, 16)
    assert fixed is not odd and fixed.data_ptr() % 16 == 0 and torch.equal(fixed, odd)


def test_permutation_is_the_documented_bit_swap():
    # input 32·c + 8·t + 4·h + 2·i + e lands at dot position 32·c + 16·h + 8·i + 2·t + e
    x = torch.arange(128, dtype=torch.float32)[None, :]
    xp = permute_x_torch(x)[0].long()
    for d in range(128):
        c, h, i, t, e = d >> 5, (d >> 4) & 1, (d >> 3) & 1, (d >> 1) & 3, d & 1
        assert xp[d] == 32 * c + 8 * t + 4 * h + 2 * i + e


def test_supports_needs_a_hopper_gpu():
    mw, _, _, _ = random_layer(16, 256)
    # no GPU here (and the interpreter cannot run Gluon): never
    assert not gluon_gemm.supports(mw, torch.float16, torch.device("cpu"))


def _pair(v: float) -> int:
    """An fp16 value in both halves of a 32-bit register (the asm's pair operands)."""
    b = f2h(v, False)
    return b | (b << 16)


def test_dequantization_asm_is_exact():
    # DEQ_ASM (the kernel's only arithmetic on the weights) run by the tests' PTX interpreter on every
    # nibble position, all 16 zero points and random nibbles: (q − z) · s rounded to fp16 once
    rng = np.random.default_rng(0)
    for z in range(16):
        s = float(np.float16(rng.uniform(0.001, 0.02)))
        lanes = []
        for _ in range(32):
            qs = [int(v) for v in rng.integers(0, 16, 8)]  # the nibble at bits 4·p
            lanes.append((qs, [sum(q << (4 * p) for p, q in enumerate(qs)), _pair(-(1024.0 + z)),
                               _pair(-(64.0 + z)), _pair(s)]))
        out = Warp(gluon_gemm.DEQ_ASM, [args for _, args in lanes], {}, False, first_input=8).run()
        for (qs, _), res in zip(lanes, out):
            for p in range(8):  # output o is input offset o, which nibble W4_ORDER.index(o) holds
                o = triton_mma.W4_ORDER[p]
                assert h2f(res[o], False) == float(np.float16((qs[p] - z) * s)), (z, p)


def test_dequantization_asm_8bit_is_exact():
    # DEQ8_ASM run by the tests' PTX interpreter: every byte position, zero points across 0 … 255 and
    # random bytes: (q − z) · s rounded to fp16 once, outputs in byte order
    rng = np.random.default_rng(1)
    for z in (0, 1, 77, 128, 200, 255):
        s = float(np.float16(rng.uniform(0.001, 0.02)))
        lanes = []
        for _ in range(32):
            qs = [int(v) for v in rng.integers(0, 256, 4)]
            lanes.append((qs, [sum(q << (8 * b) for b, q in enumerate(qs)), _pair(-(1024.0 + z)), _pair(s)]))
        out = Warp(gluon_gemm.DEQ8_ASM, [args for _, args in lanes], {}, False, first_input=4).run()
        for (qs, _), res in zip(lanes, out):
            for b in range(4):
                assert h2f(res[b], False) == float(np.float16((qs[b] - z) * s)), (z, b)


def test_gemm_declines_inside_a_capture_until_its_launches_have_run(monkeypatch):
    # a first launch loads a module, which a CUDA-graph capture forbids: while capturing, gemm() returns
    # None (launching nothing) unless both its launches ran before with the same specialization
    pytest.importorskip("triton.experimental.gluon")
    if gluon_gemm.gluon is None:
        pytest.skip("this Triton has no Gluon")
    launched = []

    class Recorder:
        def __init__(self, name, kept):
            self.name, self.kept = name, kept

        def kept_for(self, args, **options):
            return self.kept

        def __call__(self, grid, args, **options):
            launched.append(self.name)

    mw, _, _, g = random_layer(64, 256)
    x = torch.randn(20, 256, generator=g).half()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for permute_kept, gemm_kept in ((False, True), (True, False), (False, False)):
        monkeypatch.setattr(gluon_gemm, "_PERMUTE", Recorder("permute", permute_kept))
        monkeypatch.setattr(gluon_gemm, "_GEMM", Recorder("gemm", gemm_kept))
        assert gluon_gemm.gemm(x, mw, None, None, 32, 6, 64) is None
        assert gluon_gemm.gemm(x, mw, None, torch.empty(40, 64).half()[::2], 32, 6, 64) is None  # strided out
    assert launched == []
    monkeypatch.setattr(gluon_gemm, "_PERMUTE", Recorder("permute", True))
    monkeypatch.setattr(gluon_gemm, "_GEMM", Recorder("gemm", True))
    assert gluon_gemm.gemm(x, mw, None, None, 32, 6, 64).shape == (20, 64)
    assert launched == ["permute", "gemm"]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(gluon_gemm, "_GEMM", Recorder("gemm", False))
    assert gluon_gemm.gemm(x, mw, None, None, 32, 6, 64) is not None  # eagerly: always launches
    assert launched == ["permute", "gemm"] * 2
