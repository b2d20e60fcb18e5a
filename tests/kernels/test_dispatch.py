"""The dispatch's choices between layouts and kernels (the kernels themselves: test_triton_*.py)."""

from __future__ import annotations

import torch
from mma_layers import random_layer

from quantkit.kernels import capture, dispatch
from quantkit.kernels.triton_layout import KernelWeights


def test_mma_choice_by_rows_of_x():
    for bits in (4, 8):
        for n in (4096, 12288, 22016):
            for m in (1, 16, 64):
                c = dispatch.mma_choice(bits, m, n)
                assert c.method == "mma"  # one launch per 64 rows of x
            assert dispatch.mma_choice(bits, 65, n).method == "dequant+cublas"
    # narrow layers (few 16-row tiles per SM) get 8-warp programs at small M; the widest, small ones
    assert dispatch.mma_choice(4, 1, 4096).params["num_warps"] == 8
    assert dispatch.mma_choice(4, 1, 12288).params["num_warps"] == 4
    assert dispatch.mma_choice(4, 1, 22016).params["num_warps"] == 2


def test_mma_choice_row_tiles_and_pdl():
    # M = 32 on qkv-wide layers: two row tiles per warp under a 168-register budget (12 warps per SM)
    p = dispatch.mma_choice(4, 32, 12288).params
    assert p["rows"] == 2 and p["maxnreg"] == 168
    # PDL only where it measured faster, and never when the GPU (or QUANTKIT_PDL) rules it out
    assert dispatch.mma_choice(4, 1, 12288, pdl=True).params.get("pdl")
    assert not dispatch.mma_choice(4, 1, 22016, pdl=True).params.get("pdl")  # gate_up's 2-warp programs
    for m in (1, 8, 16, 32, 64):
        for n in (4096, 12288, 22016):
            assert not dispatch.mma_choice(8, m, n, pdl=False).params.get("pdl")


def test_gluon_choice_by_shape_and_rows_of_x():
    qkv, o, gate_up, down = (4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)
    for k, n in (qkv, o, gate_up, down):
        for m in (1, 16, 1025):  # the GEMV below, dequantize + cuBLAS above
            assert dispatch.gluon_choice(m, n, k) is None
        assert dispatch.gluon_choice(512, n, k).params == dict(bm=256, stages=3, rows=64)
        # above 512 only the wide layer keeps the GEMM
        assert (dispatch.gluon_choice(1024, n, k) is None) == (n != gate_up[1])
    assert dispatch.gluon_choice(32, gate_up[1], 4096).params == dict(bm=32, stages=6, rows=64)
    assert dispatch.gluon_choice(32, qkv[1], 4096) is None
    assert dispatch.gluon_choice(32, o[1], o[0]).params == dict(bm=32, stages=6, rows=64, split=2)
    assert dispatch.gluon_choice(64, down[1], down[0]).params["split"] == 4  # narrow, long K: split deeper
    assert dispatch.gluon_choice(64, o[1], o[0]).params == dict(bm=64, stages=4, rows=64, split=2)
    assert dispatch.gluon_choice(64, qkv[1], 4096).params == dict(bm=64, stages=4, rows=64)
    assert dispatch.gluon_choice(64, gate_up[1], 4096).params["stages"] == 3
    assert dispatch.gluon_choice(96, qkv[1], 4096).params == dict(bm=128, stages=4, rows=128)
    assert dispatch.gluon_choice(96, gate_up[1], 4096).params == dict(bm=64, stages=4, rows=128)
    assert dispatch.gluon_choice(128, down[1], down[0]).params == dict(bm=128, stages=3, rows=64, split=2)
    assert dispatch.gluon_choice(128, o[1], o[0]).params == dict(bm=64, stages=4, rows=64)
    assert dispatch.gluon_choice(256, qkv[1], 4096).params == dict(bm=128, stages=2, rows=64)
    assert dispatch.gluon_choice(200, gate_up[1], 4096).params == dict(bm=256, stages=3, rows=64)
    assert dispatch.gluon_choice(513, qkv[1], 4096) is None  # dequantize + cuBLAS


def test_gluon_choice_for_8bit_weights():
    qkv, o, gate_up, down = (4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)
    for k, n in (qkv, o, gate_up, down):
        for m in (1, 16, 1025):  # the GEMV below, dequantize + cuBLAS above (runs 68, 70, 72)
            assert dispatch.gluon_choice(m, n, k, bits=8) is None
        assert (dispatch.gluon_choice(1024, n, k, bits=8) is None) == (n != gate_up[1])
        assert dispatch.gluon_choice(512, n, k, bits=8).params == dict(bm=256, stages=3, rows=64)
    assert dispatch.gluon_choice(32, gate_up[1], 4096, bits=8).params == dict(bm=32, stages=4, rows=64)
    assert dispatch.gluon_choice(32, qkv[1], 4096, bits=8).params == dict(bm=32, stages=6, rows=64)  # W4: the GEMV
    assert dispatch.gluon_choice(64, down[1], down[0], bits=8).params == dict(bm=64, stages=4, rows=64, split=4)
    assert dispatch.gluon_choice(100, o[1], o[0], bits=8).params == dict(bm=128, stages=3, rows=64, split=2)
    assert dispatch.gluon_choice(256, down[1], down[0], bits=8).params == dict(bm=128, stages=3, rows=64)
    assert dispatch.gluon_choice(128, qkv[1], 4096, bits=8).params == dict(bm=64, stages=3, rows=64)
    assert dispatch.gluon_choice(200, gate_up[1], 4096, bits=8).params == dict(bm=256, stages=3, rows=64)
    assert dispatch.gluon_choice(100, gate_up[1], 4096, bits=8).params == dict(bm=128, stages=4, rows=128)
    # W4 differs at the same M (its own table)
    assert dispatch.gluon_choice(256, qkv[1], 4096).params == dict(bm=128, stages=2, rows=64)
    assert dispatch.gluon_choice(256, qkv[1], 4096, bits=8).params == dict(bm=256, stages=3, rows=64)


def test_mma_choice_takes_the_gluon_gemm_only_when_supported():
    assert dispatch.mma_choice(4, 64, 12288, k=4096, gluon=True).method == "gluon"
    assert dispatch.mma_choice(4, 64, 12288, k=4096, gluon=False).method == "mma"
    assert dispatch.mma_choice(4, 100, 12288, k=4096, gluon=False).method == "dequant+cublas"
    assert dispatch.mma_choice(8, 16, 12288, k=4096, gluon=True).method == "mma"  # W8: the GEMV to M = 16
    assert dispatch.mma_choice(8, 17, 12288, k=4096, gluon=True).method == "gluon"
    # on the CPU the layer never gets it
    mw = random_layer(16, 256)[0]
    assert dispatch.choice_for(mw, 64, torch.device("cpu")).method == "mma"


def test_choice_for_leaves_eager_small_m_to_the_gemv(monkeypatch):
    # where the Gluon GEMM could run: from a CUDA graph it takes M = 64; eagerly (its host cost) the
    # GEMV does, up to EAGER_GEMV_MAX_M; above that the GEMM either way; QUANTKIT_GLUON=0 turns it off
    monkeypatch.setattr(dispatch.gluon_gemm, "supports", lambda kw, dtype, device: True)
    monkeypatch.setattr(dispatch, "_sm_count", lambda device: 132)
    monkeypatch.delenv("QUANTKIT_GLUON", raising=False)
    mw = random_layer(12288, 256)[0]
    cpu = torch.device("cpu")
    assert not dispatch.capturing(cpu)
    assert dispatch.choice_for(mw, 64, cpu, graphed=True).method == "gluon"
    assert dispatch.choice_for(mw, 64, cpu, graphed=False).method == "mma"
    assert dispatch.choice_for(mw, 64, cpu).method == "mma"  # not capturing: eager
    assert dispatch.choice_for(mw, dispatch.EAGER_GEMV_MAX_M + 1, cpu, graphed=False).method == "gluon"
    with capture.graph_warmup():  # the warm-up before a capture launches what the capture will
        assert dispatch.choice_for(mw, 64, cpu).method == "gluon"
    monkeypatch.setenv("QUANTKIT_GLUON", "0")
    assert dispatch.choice_for(mw, 64, cpu, graphed=True).method == "mma"
    assert dispatch.choice_for(mw, 200, cpu, graphed=True).method == "dequant+cublas"


def test_run_falls_back_from_a_gluon_choice(triton_interpreter):
    # a Gluon choice handed to run() where the GEMM cannot run (here: the CPU) takes the mma path instead
    mw, _, w, g = random_layer(24, 256, seed=3)
    x = torch.randn(80, 256, generator=g).half()
    ref = x.float() @ w.t()
    out = dispatch.run(x, mw, None, dispatch.Choice("gluon", dict(bm=64, stages=3, rows=64)))
    assert ((out.float() - ref).norm() / ref.norm()) < 2e-3


def test_run_falls_back_when_the_gluon_gemm_declines(triton_interpreter, monkeypatch):
    # inside a CUDA-graph capture the GEMM returns None rather than load a module (its first launch):
    # run() then takes the dispatch's other kernel for those rows (here M = 80: dequantize + matmul)
    mw, _, w, g = random_layer(24, 256, seed=4)
    x = torch.randn(80, 256, generator=g).half()
    asked = []
    monkeypatch.setattr(dispatch.gluon_gemm, "supports", lambda kw, dtype, device: True)
    monkeypatch.setattr(dispatch.gluon_gemm, "gemm", lambda *a, **k: asked.append(k) or None)
    out = dispatch.run(x, mw, None, dispatch.Choice("gluon", dict(bm=64, stages=4, rows=64, split=2)))
    assert asked == [dict(bm=64, stages=4, rows=64, split=2)]
    ref = x.float() @ w.t()
    assert ((out.float() - ref).norm() / ref.norm()) < 2e-3


def test_pdl_is_opt_in(monkeypatch):
    monkeypatch.delenv("QUANTKIT_PDL", raising=False)
    assert not dispatch._has_pdl(torch.device("cpu"))
    monkeypatch.setenv("QUANTKIT_PDL", "1")
    assert not dispatch._has_pdl(torch.device("cpu"))  # no CUDA device: never


def test_run_mma_layout_dequantize_path(triton_interpreter):
    mw, _, w, g = random_layer(40, 256, seed=0)
    x = torch.randn(70, 256, generator=g).half()  # above 64 rows: dequantize + cuBLAS
    bias = torch.randn(40, generator=g).half()
    ref = x.float() @ w.t() + bias.float()
    choice = dispatch.choice_for(mw, x.shape[0], x.device)
    assert choice.method == "dequant+cublas"
    out = dispatch.run(x, mw, bias, choice)
    assert ((out.float() - ref).norm() / ref.norm()) < 2e-3


def test_cpu_layers_keep_the_block_planar_layout(monkeypatch):
    from quantkit.nn import QuantLinear

    layer = QuantLinear(128, 32, 4, 128, layout="packed")
    kw = dispatch.kernel_weights(layer, torch.device("cpu"), offload=False)
    assert isinstance(kw, KernelWeights)  # the mma layout is only made for CUDA devices


def test_triton_kernels_only_on_nvidia_sm80_and_later(monkeypatch, caplog):
    """The tensor-core GEMV's inline PTX needs sm_80: older NVIDIA GPUs and ROCm take the dequantize
    path (QuantLinear's torch reference); forced onto Triton there, layers keep the block-planar layout."""
    from quantkit.kernels import hardware
    from quantkit.kernels.triton_layout import pack_block_planar
    from quantkit.nn.quant_linear import kernel_choice

    monkeypatch.delenv("QUANTKIT_KERNEL", raising=False)
    monkeypatch.setattr(dispatch, "interpreted", lambda: False)
    monkeypatch.setattr(hardware, "_logged", set())
    q = torch.randint(0, 16, (64, 256))
    kw = KernelWeights(pack_block_planar(q, 4), torch.ones(64, 2).half(), torch.zeros(64, 2, dtype=torch.uint8),
                       4, 128, 256, 64)
    cuda = torch.device("cuda", 0)
    cases = [(None, (9, 0), True), (None, (8, 0), True), (None, (8, 9), True), (None, (7, 5), False),
             (None, (7, 0), False), ("6.2.41134", (9, 4), False)]
    for hip, capability, capable in cases:
        monkeypatch.setattr(hardware, "_capable", {})
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        assert hardware.mma_capable(cuda) == capable, (hip, capability)
        assert kernel_choice(cuda) == ("triton" if capable else "reference")
        assert dispatch.takes_mma_layout(kw, cuda, torch.float16) == capable
    assert not hardware.mma_capable(torch.device("cpu"))
    # one log line per kind of refusal, however many layers ask
    monkeypatch.setattr(hardware, "_logged", set())
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))
    caplog.clear()
    with caplog.at_level("WARNING", logger="quantkit.kernels.hardware"):
        for _ in range(3):
            monkeypatch.setattr(hardware, "_capable", {})
            hardware.mma_capable(cuda)
    assert len(caplog.records) == 1 and "compute capability 7.5" in caplog.text
