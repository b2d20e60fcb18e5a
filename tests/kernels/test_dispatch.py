"""The dispatch: every kernel its table can choose computes the linear, and the rule that picks from the
table (the kernels alone: test_triton_*.py; on the GPU: tests/gpu/test_gpu_kernels.py)."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from quantkit_testing.kernel_oracles import packed_layer
from quantkit_testing.mma_layers import random_layer

from quantkit.config import UserError
from quantkit.kernels import capture, dispatch
from quantkit.kernels.settings import KernelSettings
from quantkit.kernels.triton_layout import KernelWeights

MS = range(1, 2049)
LLAMA2_7B = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}  # n, k


INT_KEYS = [key for key in dispatch.TABLE if not key.startswith("fp8 ")]  # the FP8 rows: test_fp8_rows_*


def key_parts(key: str) -> tuple[int, str]:
    bits, cls = key.split(" ", 1)
    return int(bits[1:]), cls


def picked(key: str, gluon: bool) -> dict[int, list[int]]:
    """{row index: the Ms of MS at which `choose` picks that row of TABLE[key]}."""
    bits, cls = key_parts(key)
    rows = dispatch.TABLE[key]
    out = defaultdict(list)
    for m in MS:
        c = dispatch.choose(bits, m, cls, gluon)
        out[next(i for i, (_, row) in enumerate(rows) if row is c)].append(m)
    return out


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_rows_are_sorted_and_the_last_covers_every_m():
    for key in INT_KEYS:
        rows = dispatch.TABLE[key]
        bits, cls = key_parts(key)
        assert [b for b, _ in rows] == sorted(b for b, _ in rows), key
        for gluon in (False, True):
            assert dispatch.choose(bits, 10**9, cls, gluon) is rows[-1][1], key


def test_the_first_allowed_row_whose_bound_holds_m_is_picked_and_every_row_is_reachable():
    for key in INT_KEYS:
        rows = dispatch.TABLE[key]
        reached = set()
        for gluon in (False, True):
            for i, ms in picked(key, gluon).items():
                reached.add(i)
                assert gluon or rows[i][1].method != "gluon", key
                earlier = [b for b, c in rows[:i] if gluon or c.method != "gluon"]
                assert all(m <= rows[i][0] and all(b < m for b in earlier) for m in ms), (key, i)
        assert reached == set(range(len(rows))), (key, set(range(len(rows))) - reached)


def test_fp8_rows_the_first_whose_bound_holds_m_is_picked_by_each_llama_linear():
    from quantkit.kernels.dispatch_table import choose_fp8

    for name, (n, k) in LLAMA2_7B.items():
        rows = dispatch.TABLE[f"fp8 {dispatch.width_class(n, k, 132)}"]
        assert [b for b, _ in rows] == sorted(b for b, _ in rows) and rows[-1][1].method == "scaled_mm", name
        reached = set()
        for m in MS:
            i = next(i for i, (bound, _) in enumerate(rows) if m <= bound)
            assert choose_fp8(m, n, k, 132) is rows[i][1], (name, m)
            reached.add(i)
            # cuBLAS cannot run it (the CPU, odd shapes): the Triton kernel of the last Triton row
            assert choose_fp8(m, n, k, 132, triton_only=True).method == "fp8-dot"
        assert reached == set(range(len(rows))), name


def test_the_choice_depends_on_the_width_class_and_m_only():
    for sms in (4, 108, 132):
        for bits in (4, 8):
            first: dict[str, list] = {}
            for n in (16, 1000, 4096, 4240, 12288, 12688, 22016, 28672):
                for k in (2048, 8192, 8200, 14336):
                    choices = [dispatch.mma_choice(bits, m, n, sms, True, k, gluon)
                               for m in range(1, 1100) for gluon in (False, True)]
                    assert first.setdefault(dispatch.width_class(n, k, sms), choices) == choices, (sms, bits, n, k)


def test_the_llama2_7b_linears_fall_in_the_classes_they_were_measured_for():
    classes = {name: dispatch.width_class(n, k, 132) for name, (n, k) in LLAMA2_7B.items()}
    assert classes == {"qkv": "mid", "o": "narrow", "gate_up": "wide", "down": "narrow-long-k"}
    # wider layers never fall in a narrower class
    order = ["narrow", "mid", "wide"]
    for sms in (4, 108, 132):
        seen = [order.index(dispatch.width_class(n, 4096, sms).replace("-long-k", "")) for n in range(16, 40000, 16)]
        assert seen == sorted(seen)


@pytest.mark.parametrize("bits", [4, 8])
def test_every_block_planar_choice_computes_the_linear(triton_interpreter, bits):
    """dispatch.run with each block-planar row, at the first and last M it is picked for, equals
    dequantize + F.linear (the GEMV and GEMM split K as the CPU's 4 "SMs" ask)."""
    g = torch.Generator().manual_seed(bits)
    n, k, gsz = 40, 256, 64 if bits == 4 else 256
    q = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.int32)
    z = torch.randint(1, 2**bits - 1, (n, k // gsz), generator=g, dtype=torch.int32)
    s = (torch.rand(n, k // gsz, generator=g) * 0.02 + 0.002).half()
    kw, w = packed_layer(q, z, s, bits, gsz, "awq" if bits == 4 else "packed", False)
    bias = torch.randn(n, generator=g).half()
    key = f"w{bits} block-planar"
    methods = set()
    for i, ms in picked(key, False).items():
        choice = dispatch.TABLE[key][i][1]
        for m in {ms[0], min(ms[-1], 70)}:
            x = torch.randn(m, k, generator=g).half()
            assert dispatch.choose(bits, m) is choice
            err = rel(dispatch.run(x, kw, bias, choice), F.linear(x.float(), w.float(), bias.float()))
            assert err < 1e-2, (choice, m, err)
        methods.add(choice.method)
    assert methods == {"gemv", "gemm", "dequant+cublas"}


@pytest.mark.parametrize("bits", [4, 8])
def test_every_mma_layout_choice_computes_the_linear(mma_asm, bits):
    """dispatch.run with each mma-GEMV and dequantize row of the mma layout (its parameters as the table
    gives them, PDL included), at the first M it is picked for, equals dequantize + F.linear; the GEMV's
    inline PTX runs in the PTX interpreter. (The Gluon GEMM needs a Hopper GPU: tests/gpu.)"""
    mw, _, w, g = random_layer(24, 256, bits, 128, seed=bits)  # two row tiles: one program of two, or two
    bias = torch.randn(24, generator=g).half()
    done = []
    for key in [key for key in dispatch.TABLE if key.startswith(f"w{bits} ") and "block-planar" not in key]:
        for i, ms in picked(key, False).items():
            choice = dispatch.TABLE[key][i][1]
            if choice in done:
                continue
            done.append(choice)
            x = torch.randn(ms[0], 256, generator=g).half()
            mma_asm(x, mw.qweight)
            err = rel(dispatch.run(x, mw, bias, choice), F.linear(x.float(), w, bias.float()))
            assert err < 1e-2, (key, choice, ms[0], err)
    assert {c.method for c in done} == {"mma", "dequant+cublas"}


def test_eager_calls_leave_small_m_to_the_gemv(monkeypatch):
    """Where the Gluon GEMM could run (here pretended): eager calls with M ≤ EAGER_GEMV_MAX_M never take it,
    graphed ones do where the table says; above that bound both choose alike; settings with gluon off
    turn it off."""
    monkeypatch.setattr(dispatch.gluon_gemm, "supports", lambda kw, dtype, device: True)
    monkeypatch.setattr(dispatch, "_sm_count", lambda device: 1)  # 16-row tiles per SM = row tiles
    monkeypatch.setattr(dispatch, "_has_pdl", lambda device, kernels: True)  # the table's rows as they are
    cpu, cut = torch.device("cpu"), dispatch.EAGER_GEMV_MAX_M
    graphed_gluon = set()
    for n, k, cls in ((24, 256, "narrow"), (24, 8320, "narrow-long-k"), (64, 256, "mid"), (128, 256, "wide")):
        mw = random_layer(n, k)[0]
        assert dispatch.width_class(n, k, 1) == cls
        for m in range(1, 1100):
            eager, graphed = (dispatch.choice_for(mw, m, cpu, graphed=flag) for flag in (False, True))
            assert graphed == dispatch.choose(4, m, cls, gluon=True)
            if m <= cut:
                assert eager.method != "gluon" and eager == dispatch.choose(4, m, cls), (cls, m)
                if graphed.method == "gluon":
                    graphed_gluon.add(cls)
            else:
                assert eager == graphed, (cls, m)
        with capture.graph_warmup():  # the warm-up before a capture launches what the capture will
            assert dispatch.choice_for(mw, cut, cpu) == dispatch.choice_for(mw, cut, cpu, graphed=True)
        off = KernelSettings(gluon=False)
        assert all(dispatch.choice_for(mw, m, cpu, graphed=True, kernels=off).method != "gluon" for m in range(1, 1100))
    assert graphed_gluon == {"narrow", "narrow-long-k", "mid", "wide"}  # the eager rule did change something


def test_pdl_parameters_only_where_the_gpu_launches_with_pdl():
    for key in INT_KEYS:
        bits, cls = key_parts(key)
        if cls == "block-planar":
            continue
        n, k = {"narrow": (16, 256), "narrow-long-k": (16, 8320), "mid": (64, 256), "wide": (128, 256)}[cls]
        for m in MS:
            on, off = (dispatch.mma_choice(bits, m, n, 1, pdl, k) for pdl in (True, False))
            assert on == dispatch.choose(bits, m, cls)
            assert "pdl" not in off.params and "prefetch" not in off.params
            assert (off.method, off.params) == (on.method, {p: v for p, v in on.params.items()
                                                            if p not in ("pdl", "prefetch")})


def test_pdl_is_opt_in(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert not dispatch._has_pdl(cuda, KernelSettings())
    assert dispatch._has_pdl(cuda, KernelSettings(pdl=True))
    assert not dispatch._has_pdl(cuda, KernelSettings.from_env({}))
    assert dispatch._has_pdl(cuda, KernelSettings.from_env({"QUANTKIT_PDL": "1"}))
    assert not dispatch._has_pdl(torch.device("cpu"), KernelSettings(pdl=True))  # no CUDA device: never


def test_a_table_file_replaces_the_rows_it_names(triton_interpreter, tmp_path):
    path = tmp_path / "table.json"
    gemv = {"method": "gemv", "params": {"block_n": 16, "blocks": 2, "num_warps": 4, "num_stages": 1}}
    path.write_text(json.dumps({"w4 block-planar": [[3, gemv], [1 << 30, {"method": "dequant+cublas"}]]}))
    before = {key: list(rows) for key, rows in dispatch.TABLE.items()}
    table = KernelSettings.from_env({"QUANTKIT_DISPATCH_TABLE": str(path)}).dispatch_rows()
    assert [dispatch.choose(4, m, table=table).method for m in (1, 3, 4)] == ["gemv", "gemv", "dequant+cublas"]
    assert table["w4 mid"] == before["w4 mid"]  # the classes the file does not name keep their rows
    assert dispatch.TABLE == before  # and the package's table is left as it is
    kw, w = packed_layer(torch.randint(0, 16, (24, 128), dtype=torch.int32),
                         torch.randint(0, 16, (24, 1), dtype=torch.int32),
                         (torch.rand(24, 1) * 0.02 + 0.002).half(), 4, 128, "awq", False)
    x = torch.randn(3, 128).half()
    assert rel(dispatch.run(x, kw, None, dispatch.choose(4, 3, table=table)), x.float() @ w.float().t()) < 1e-2


@pytest.mark.parametrize("text, says", [
    ("{not json", "cannot read it as JSON"),
    ('[[1, {"method": "gemv"}]]', "expected an object"),
    ('{"4": [[1, {"method": "dequant+cublas"}]]}', "unknown class '4'"),
    ('{"w4 block-planar": [[1, {"method": "dequant+cublas", "tiles": 2}]]}', "must hold rows"),
    ('{"w4 block-planar": [[9, {"method": "gemv"}], [1, {"method": "dequant+cublas"}]]}', "sorted by M"),
    ('{"w4 mid": [[1, {"method": "dequant+cublas"}], [9, {"method": "gluon"}]]}', 'not "gluon"'),
    ('{"w4 mid": [[1, {"method": "gemv"}]]}', "use only"),
])
def test_a_malformed_table_file_gets_a_one_line_error(tmp_path, text, says):
    path = tmp_path / "table.json"
    path.write_text(text)
    before = {key: list(rows) for key, rows in dispatch.TABLE.items()}
    with pytest.raises(UserError) as err:
        KernelSettings.from_env({"QUANTKIT_DISPATCH_TABLE": str(path)}).dispatch_rows()
    assert says in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)
    assert dispatch.TABLE == before


def test_cpu_layers_never_get_the_gluon_gemm(triton_interpreter):
    mw = random_layer(16, 256)[0]
    cpu = torch.device("cpu")
    assert all(dispatch.choice_for(mw, m, cpu, graphed=g).method != "gluon" for m in range(1, 1100) for g in (0, 1))


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


def test_cpu_layers_keep_the_block_planar_layout():
    from quantkit.nn import QuantLinear

    layer = QuantLinear(128, 32, 4, 128, layout="packed")
    kw = dispatch.kernel_weights(layer, torch.device("cpu"), offload=False)
    assert isinstance(kw, KernelWeights)  # the mma layout is only made for CUDA devices


def test_triton_kernels_only_on_nvidia_sm80_and_later(monkeypatch, caplog):
    """The tensor-core GEMV's inline PTX needs sm_80: older NVIDIA GPUs and ROCm take the dequantize
    path (QuantLinear's torch reference); forced onto Triton there, layers keep the block-planar layout."""
    from quantkit.kernels import hardware
    from quantkit.kernels.triton_layout import pack_block_planar
    monkeypatch.setattr(dispatch, "interpreted", lambda: False)
    q = torch.randint(0, 16, (64, 256))
    kw = KernelWeights(pack_block_planar(q, 4), torch.ones(64, 2).half(), torch.zeros(64, 2, dtype=torch.uint8),
                       4, 128, 256, 64)
    cuda = torch.device("cuda", 0)
    cases = [(None, (9, 0), True), (None, (8, 0), True), (None, (8, 9), True), (None, (7, 5), False),
             (None, (7, 0), False), ("6.2.41134", (9, 4), False)]
    for hip, capability, capable in cases:
        hardware.device_capable.cache_clear()
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        assert hardware.mma_capable(cuda) == capable, (hip, capability)
        assert KernelSettings().triton(cuda) == capable and KernelSettings(path="triton").triton(cuda)
        assert dispatch.takes_mma_layout(kw, cuda, torch.float16) == capable
    assert not hardware.mma_capable(torch.device("cpu"))
    # one log line per device, however many layers ask
    hardware.device_capable.cache_clear()
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))
    caplog.clear()
    with caplog.at_level("WARNING", logger="quantkit.kernels.hardware"):
        for _ in range(3):
            hardware.mma_capable(cuda)
    assert len(caplog.records) == 1 and "compute capability 7.5" in caplog.text
    hardware.device_capable.cache_clear()  # the next test asks the real device
