"""Which kernel runs a quantized linear: chosen by bits and M from tables measured on the H200.

`quant_linear(x, layer)` is what `QuantLinear.forward` calls on the Triton path. The layer's packed
buffers are repacked once into a kernel layout and kept on the layer as a plain attribute, rebuilt if
the layer moves to another device:
- on a CUDA GPU, layers the tensor-core GEMV takes (triton_mma.supports) get the mma layout: M ≤ 64
  runs the mma GEMV, larger M dequantizes (mma layout) and calls cuBLAS (`mma_choice`, figures
  in BENCHMARKS.md and bench/KERNELS_NOTES.md); on Hopper, with fp16 activations, the Gluon GEMM
  (gluon_gemm) takes 16 < M ≤ 512, to 1024 on wide layers, where it measured faster (`gluon_choice`).
  Each layer keeps its GEMV launches per M and dtype (`gemv_launch`), which after the first call skip Triton's
  argument binding: an eager call costs about a quarter of the host time it did
  (bench/probes/launch_overhead.py);
- otherwise (other group sizes, bf16 with 8 bits, the Triton interpreter, which cannot run the mma
  kernel's inline PTX) the block-planar layout (triton_layout) and `TABLE`, measured by
  bench/kernels.py --tune; split-K is set per call so that a launch has enough programs to fill
  the GPU. QUANTKIT_DISPATCH_TABLE=path.json replaces that table (the format `use_table` takes).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

from quantkit.kernels import gluon_gemm, triton_gemm, triton_gemv, triton_mma
from quantkit.kernels.capture import capturing
from quantkit.kernels.hardware import mma_capable
from quantkit.kernels.launch import interpreted
from quantkit.kernels.triton_layout import KernelWeights, from_module
from quantkit.kernels.triton_mma import MmaWeights


@dataclass(frozen=True)
class Choice:
    """A kernel and its tile parameters; `programs` is the split-K target in programs per SM."""

    method: str  # "gemv", "gemm", "mma", "gluon" or "dequant+cublas"
    params: dict = field(default_factory=dict)
    programs: float = 4.0


def _gemv(block_n: int, blocks: int, num_warps: int, programs: float, num_stages: int = 1) -> Choice:
    return Choice("gemv", dict(block_n=block_n, blocks=blocks, num_warps=num_warps, num_stages=num_stages), programs)


def _gemm(block_m: int, block_n: int, programs: float) -> Choice:
    return Choice("gemm", dict(block_m=block_m, block_n=block_n, blocks=8, num_warps=4, num_stages=3, swap_ab=True),
                  programs)


_CUBLAS = Choice("dequant+cublas")
# bits → rows of (largest M, choice); the first row whose bound is ≥ M is used. Measured on the H200
# by `bench/kernels.py --tune` (least time summed over the four Llama-2-7B linears, per M; see
# bench/KERNELS_NOTES.md). From M = 64 (W4) and beyond M = 16 (W8) every fused kernel
# tried lost to dequantize (16-byte stores, ≈ 90 % of copy bandwidth) + cuBLAS.
TABLE: dict[int, list[tuple[int, Choice]]] = {
    4: [
        (1, _gemv(32, 16, 2, 8)),
        (2, _gemv(32, 16, 2, 4)),
        (16, _gemm(16, 64, 4)),
        (32, _gemm(32, 64, 4)),
        (1 << 30, _CUBLAS),
    ],
    8: [
        (1, _gemv(32, 16, 2, 8)),
        (16, _gemm(16, 64, 4)),
        (1 << 30, _CUBLAS),
    ],
}


def use_table(table: dict) -> None:
    """Replace the table, e.g. with one that bench/kernels.py --tune measured on another GPU.

    `table` maps bits (as a string or int) to rows [largest M, {"method", "params", "programs"}].
    """
    for bits, rows in table.items():
        TABLE[int(bits)] = [(int(bound), c if isinstance(c, Choice) else Choice(**c)) for bound, c in rows]


def _table_from_env() -> None:
    path = os.environ.get("QUANTKIT_DISPATCH_TABLE")
    if path and path != _loaded.get("path"):
        use_table(json.loads(Path(path).read_text()))
        _loaded["path"] = path


_loaded: dict[str, str] = {}


def choose(bits: int, m: int) -> Choice:
    """The table's kernel for `bits`-bit weights and M rows of activations."""
    _table_from_env()
    for bound, choice in TABLE[bits]:
        if m <= bound:
            return choice
    return TABLE[bits][-1][1]


def gluon_choice(m: int, n: int, k: int, sms: int = 132, bits: int = 4) -> Choice | None:
    """The Gluon GEMM's configuration for M rows of x, N outputs and K inputs (8-bit weights:
    `gluon_choice8`; this docstring is W4's), or None where the mma GEMV (M ≤ 32 on most layers) or
    dequantize + cuBLAS (M > 512 except on wide layers, M > 1024) is faster. Measured on the H200 with
    `bench/probes/gluon_probe.py` (four Llama-2-7B shapes, CUDA-graph medians, x permutation included,
    M ∈ {16, 32, 64, 96, 128, 256, 512, 1024}; see bench/KERNELS_NOTES.md):
    - M ≤ 16: the GEMV everywhere (o 8.3 µs against 11.3 for the best GEMM; qkv 14.8 against 18.9).
    - M ≤ 32: the GEMM on wide layers (gate_up 28.8 vs 28.9 µs) and, split K ways in one launch, on
      narrow ones (o 12.2 vs 12.8, down 20.3 vs 24.5); qkv keeps the GEMV (19.5 vs 20.0: level).
    - M ≤ 64: qkv 23.7 µs (BM 64), gate_up 33.6, o 12.8 (split 2; the GEMV 15.8), down 23.4 (split 4; the
      GEMV 38.5).
    - M ≤ 128: 128 rows of x per program: qkv 30.7, gate_up 51.0 (61.0 at BM 64), down split 2 33.7
      (45.3); o keeps BM 64 (16.4 vs 17.5). At M ≤ 96, qkv and gate_up take what measured fastest at
      M = 96: 128 weight rows per program, BM 128 (qkv) and BM 64 (gate_up).
    - M ≤ 256: BM 128; qkv with two ring slots (52.7 vs 55.8 µs), down split 2 (50.3 vs 54.2); gate_up
      BM 256 (86.4 vs 90.9 µs; 255 registers, 348 bytes spilled in the epilogue only).
    - M ≤ 512: BM 256, three slots (qkv 86.9 vs 90.9 µs for BM 128, o 29.3 vs 31.5, down 78.2 vs
      83.6, gate_up 172.3 vs 170.8, level); dequantize + cuBLAS was 2–12 % slower than BM 128.
    - M ≤ 1024: gate_up BM 256 (316.4 vs 347.9 µs for dequantize + cuBLAS); the others
      dequantize + cuBLAS (qkv and o level with the GEMM, down 4 % faster), as everything above 1024.
    A choice measured at M holds below it down to the previous measured M: the GEMM's time follows the
    number of BM-row tiles of x."""
    if bits == 8:
        return gluon_choice8(m, n, k, sms)
    if m <= 16 or m > 1024:
        return None
    narrow, wide, long_k = _width(n, k, sms)
    g = _gluon
    if m <= 32:
        if narrow:
            return g(32, 6, 64, 4 if long_k else 2)
        return g(32, 6) if wide else None
    if m <= 64:
        if narrow:
            return g(64, 4, 64, 4 if long_k else 2)
        return g(64, 3) if wide else g(64, 4)
    if m <= 128:
        if narrow:
            return g(128, 3, 64, 2) if long_k else g(64, 4)
        if m <= 96:
            return g(64, 4, 128) if wide else g(128, 4, 128)
        return g(128, 3)
    if m <= 256:
        if narrow and long_k:
            return g(128, 3, 64, 2)
        return g(128, 3) if narrow else g(256, 3) if wide else g(128, 2)
    if m <= 512:
        return g(256, 3)
    return g(256, 3) if wide else None


def _width(n: int, k: int, sms: int) -> tuple[bool, bool, bool]:
    """(narrow, wide, long K) for the GEMV's and the Gluon GEMM's tables: ≤ 2 or > 6 16-row tiles per SM
    (o and down, gate_up; qkv between), K over 8192 (down)."""
    rows = triton.cdiv(n, 16)
    return rows <= 2 * sms, rows > 6 * sms, k > 8192


def _gluon(bm: int, stages: int, rows_per_program: int = 64, split: int = 1) -> Choice:
    p = dict(bm=bm, stages=stages, rows=rows_per_program)
    if split > 1:
        p["split"] = split
    return Choice("gluon", p)


def gluon_choice8(m: int, n: int, k: int, sms: int = 132) -> Choice | None:
    """The Gluon GEMM's configuration for 8-bit per-channel weights, or None where the mma GEMV (M ≤ 16)
    or dequantize + cuBLAS (M > 512 except on wide layers, M > 1024) runs. Measured on the H200
    (`bench/probes/gluon_probe.py --bits 8`, CUDA-graph medians, four Llama-2-7B shapes,
    M ∈ {32, 64, 128, 256, 512, 1024}; M ≤ 16 not probed; see bench/KERNELS_NOTES.md):
    - M ≤ 32: qkv 21.1 µs against the GEMV's 23.5, o split 2 12.4 / 14.1, gate_up with four
      slots 30.2 / 36.0, down split 4 20.3 / 27.5.
    - M ≤ 64: qkv 23.4 / 39.3, o split 2 13.0 / 19.8, gate_up 34.0 / 79.3, down split 4 24.5 / 42.7.
    - M ≤ 128: qkv BM 64, 3 slots (32.5 µs; dequantize + cuBLAS 73.5), gate_up 128 rows per program
      (63.7; 128.6), o and down BM 128 split 2 (18.8 and 37.0; 27.4 and 69.5). M = 65–127 are not
      measured: the M = 128 choice, where dequantize + cuBLAS was 1.5–2.3× slower.
    - M ≤ 256: o and down BM 128 unsplit (22.3, 56.0); qkv and gate_up BM 256 (58.4
      and 90.4 µs against 61.9 for BM 64 and 96.2 for 128 rows per program).
    - M ≤ 512: BM 256 everywhere (qkv 92.7 against 98.0 for BM 128 with 128 rows, o 30.6 / 33.7,
      gate_up 177.9 / 194.8, down 78.3 / 83.7; dequantize + cuBLAS 109.3 / 38.3 / 197.7 / 96.3).
    - M ≤ 1024: gate_up BM 256 (329.7 vs 349.0 µs for dequantize + cuBLAS); the others dequantize +
      cuBLAS (qkv 176.2 vs 181.1, down 151.7 vs 154.0, o level), as everything above 1024."""
    if m <= 16 or m > 1024:
        return None
    narrow, wide, _ = _width(n, k, sms)
    if m <= 32 and not narrow:
        return _gluon(32, 4) if wide else _gluon(32, 6)
    if m <= 64:  # W4's choices, measured the fastest for W8 too
        return gluon_choice(m, n, k, sms)
    if m <= 128:
        if narrow:
            return _gluon(128, 3, 64, 2)
        return _gluon(128, 4, 128) if wide else _gluon(64, 3)
    if m <= 256:
        return _gluon(128, 3) if narrow else _gluon(256, 3)
    if m <= 512:
        return _gluon(256, 3)
    return _gluon(256, 3) if wide else None


def mma_choice(bits: int, m: int, n: int, sms: int = 132, pdl: bool = True, k: int = 0,
               gluon: bool = False) -> Choice:
    """The mma-layout kernel for M rows of x and N outputs on a GPU with `sms` SMs (`pdl`: the GPU
    has programmatic dependent launch, sm_90 and later).

    Measured on the H200 (`bench/lib/kernels_mma.py` sweep and probe, four Llama-2-7B shapes,
    M ∈ {1, 8, 16, 32, 64}): the mma GEMV up to M = 64, set by the width of the layer in 16-row tiles
    and by the column tiles (8 rows of x each). Narrow layers (o,
    down: 256 row tiles) want 8 warps per program splitting K; layers with ≤ 6 row tiles per SM (qkv)
    4 warps; wider ones (gate_up) 2. From M = 32, wide and mid layers take 2 row tiles per warp (x
    shared between them) under a 168-register budget (12 warps per SM instead of 8). Programmatic
    dependent launch (prefetch of one K-tile per warp before the wait) wherever it measured faster:
    4–20 % at M ≤ 16 except for the 2-warp programs of gate_up, which it slowed by 12 %. Each choice
    is the fastest configuration timed for its shape and M, or within 3 % of it. Above M = 64
    dequantize + cuBLAS. With `gluon` (fp16 activations on Hopper: gluon_gemm.supports) the Gluon GEMM
    takes the rows of M where `gluon_choice` (W4) or `gluon_choice8` (W8) measured it faster.
    """
    if gluon:
        choice = gluon_choice(m, n, k, sms, bits)
        if choice is not None:
            return choice
    if m > 64:
        return _CUBLAS

    def mma(num_warps: int, tiles: int = 1, maxnreg: int | None = None, row_tiles: int = 1,
            early: bool = False) -> Choice:
        p = dict(num_warps=num_warps, tiles=tiles, maxnreg=maxnreg)
        if row_tiles > 1:
            p["rows"] = row_tiles
        if early and pdl:
            p.update(pdl=True, prefetch=1)
        return Choice("mma", p)

    narrow, wide, _ = _width(n, k, sms)
    mid = not wide
    if m <= 8:
        if narrow:
            return mma(8, 2, 128, early=True)
        return mma(4, 1, 128, early=True) if mid or bits == 8 else mma(2)
    if m <= 16:
        return mma(8, 2, 128, early=True) if narrow else mma(4, early=True) if mid else mma(2)
    if m <= 32:
        return mma(8, early=True) if narrow else mma(4, 1, 168, 2) if mid else mma(2, 1, 168, 2)
    return mma(4, 2, early=True) if narrow else mma(2, 1, None, 2) if mid else mma(4, 1, None, 2)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the Triton interpreter on the CPU: keep some split-K in play so CI exercises it


def _has_pdl(device: torch.device) -> bool:
    """Whether to use programmatic dependent launch (griddepcontrol, NVIDIA sm_90 and later): only with
    QUANTKIT_PDL=1. It speeds up back-to-back GEMVs (4–20 % at M ≤ 16), but in the graphed decode
    step, where a GEMV follows kernels that never trigger early, it measured 0.98× (paired median;
    0.96–1.13×) when interleaved with it off on one machine (bench/KERNELS_NOTES.md has the measurement),
    so it is off by default."""
    if os.environ.get("QUANTKIT_PDL", "0") != "1" or device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def takes_mma_layout(kw: KernelWeights, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a layer gets the mma layout (tensor-core GEMV, Gluon GEMM) rather than the block-planar
    one: on an NVIDIA GPU of compute capability 8.0 or later (hardware.mma_capable; ROCm and older GPUs
    reach this module only with QUANTKIT_KERNEL=triton) and not under the Triton interpreter, which
    cannot run the GEMV's inline PTX, for a layer and activation dtype the kernel takes."""
    return (device.type == "cuda" and not interpreted() and mma_capable(device)
            and triton_mma.supports(kw.bits, kw.group_size, kw.in_features, kw.scales.shape[1], dtype))


def split_k_for(tiles: int, k_steps: int, device: torch.device, programs_per_sm: float) -> int:
    """Split K until the launch has about `programs_per_sm` programs per SM (at most 16, ≥ 2 steps each)."""
    want = programs_per_sm * _sm_count(device)
    split = 1
    while split < 16 and tiles * split * 2 <= want and k_steps >= 4 * split:
        split *= 2
    return split


def kernel_weights(
    layer: torch.nn.Module,
    device: torch.device | None = None,
    offload: bool | None = None,
    dtype: torch.dtype = torch.float16,
) -> KernelWeights | MmaWeights:
    """The layer's weights in its kernel layout on `device`, made at the first call and kept on the layer.

    The layout is the mma one where `takes_mma_layout` says so (an sm_80+ NVIDIA GPU and a layer the
    mma GEMV takes with `dtype` activations), else block-planar. The kernel layout holds the same
    bytes as the checkpoint tensors, so keeping both would double the weight memory. With `offload` (default: on CUDA) the checkpoint tensors
    move to host memory once the kernel layout exists: the state dict stays complete and the reference
    path still works (it dequantizes on the host), while the accelerator holds one copy of the weight.
    """
    ref = layer.qweight if layer.layout == "awq" else layer.weight_packed
    device = ref.device if device is None else device
    offload = device.type == "cuda" if offload is None else offload
    kw = getattr(layer, "_kernel_weights", None)
    if kw is None or kw.qweight.device != device:
        if ref.device != device:  # the checkpoint tensors were offloaded: repack them on `device`
            layer.to(device)
        kw = from_module(layer)
        if takes_mma_layout(kw, device, dtype):
            kw = triton_mma.from_kernel_weights(kw)
        layer._kernel_weights = kw
        if offload:
            layer.offload_checkpoint_tensors()
    return kw


def run(x2d: torch.Tensor, kw: KernelWeights | MmaWeights, bias: torch.Tensor | None, choice: Choice) -> torch.Tensor:
    """y [M, N] for x [M, K] with the given choice (which must suit the layout of `kw`)."""
    m = x2d.shape[0]
    n = kw.out_features
    if choice.method == "dequant+cublas":
        if isinstance(kw, MmaWeights):
            w = triton_mma.dequantize(kw, x2d.dtype)
        else:
            w = triton_gemm.dequantize(kw, x2d.dtype)
        return torch.nn.functional.linear(x2d, w, None if bias is None else bias.to(x2d.dtype))
    p = choice.params
    if choice.method == "gluon":
        if isinstance(kw, MmaWeights) and gluon_gemm.supports(kw, x2d.dtype, x2d.device):
            y = gluon_gemm.gemm(x2d, kw, bias, **p)
            if y is not None:
                return y
        # e.g. bf16 x, or a capture whose warm-up ran another kernel (the Gluon one would load a module)
        choice = mma_choice(kw.bits, m, n, _sm_count(x2d.device), _has_pdl(x2d.device))
        return run(x2d, kw, bias, choice)
    if choice.method == "mma":
        launch = gemv_launch(kw, bias, m, x2d.dtype, x2d.device, choice.params)
        if launch is not None:
            return launch(x2d)
        dtype = x2d.dtype
        if not triton_mma.supports(kw.bits, kw.group_size, kw.in_features, kw.scales.shape[1], dtype):
            x2d = x2d.half()  # e.g. bf16 activations with 8-bit weights: fp16 operands, fp32 sums
        out = torch.empty(m, n, dtype=x2d.dtype, device=x2d.device)
        for r in range(0, m, 64):  # at most 64 rows of x per launch (8 per column tile of the B operand)
            triton_mma.gemv(x2d[r:r + 64], kw, bias, out=out[r:r + 64], **p)
        return out.to(dtype)
    k8 = kw.qweight.shape[1]
    if choice.method == "gemv":
        tiles = m * triton.cdiv(n, p["block_n"])
        split = split_k_for(tiles, triton.cdiv(k8, 4 * p["blocks"]), x2d.device, choice.programs)
        return triton_gemv.gemv(x2d, kw, bias, split_k=split, **p)
    tiles = triton.cdiv(m, p["block_m"]) * triton.cdiv(n, p["block_n"])
    split = split_k_for(tiles, triton.cdiv(k8, 4 * p["blocks"]), x2d.device, choice.programs)
    return triton_gemm.gemm(x2d, kw, bias, split_k=split, **p)


def gluon_enabled() -> bool:
    """Whether the Gluon GEMM may be chosen: unless QUANTKIT_GLUON=0 (then the GEMV and dequantize +
    cuBLAS take its rows of M)."""
    return os.environ.get("QUANTKIT_GLUON", "1") != "0"


# Up to this M, an eager call takes the mma GEMV even where the Gluon GEMM is faster on the GPU: the
# Gluon call costs 74–94 µs of host time (two launches, a TMA descriptor; bench/probes/launch_overhead.py
# --gluon, M = 32 and 64) for 12–33 µs of GPU time, so back-to-back eager calls measured 81–94 µs per
# call against the GEMV's 16–78 (plain launches, all four Llama-2-7B shapes). Inside
# a CUDA graph the host cost is gone and the GEMM is faster. Above it the GEMM's eager call is level
# with dequantize + cuBLAS's (81–105 µs against 49–139) and faster graphed, so it is chosen either way.
EAGER_GEMV_MAX_M = 64


def choice_for(kw: KernelWeights | MmaWeights, m: int, device: torch.device,
               dtype: torch.dtype = torch.float16, graphed: bool | None = None) -> Choice:
    """The kernel for these weights and M rows of `dtype` x: `mma_choice` for the mma layout, else the
    table. graphed: whether the call will run from a CUDA graph (None: whether the stream is capturing
    now); eager calls leave M ≤ EAGER_GEMV_MAX_M to the GEMV."""
    if isinstance(kw, MmaWeights):
        if graphed is None:
            graphed = capturing(device)
        gluon = (gluon_enabled() and (graphed or m > EAGER_GEMV_MAX_M)
                 and gluon_gemm.supports(kw, dtype, device))
        return mma_choice(kw.bits, m, kw.out_features, _sm_count(device), _has_pdl(device), kw.in_features, gluon)
    return choose(kw.bits, m)


def gemv_launch(kw: KernelWeights | MmaWeights, bias: torch.Tensor | None, m: int, dtype: torch.dtype,
                device: torch.device, params: dict | None = None,
                graphed: bool = False) -> triton_mma.GemvLaunch | None:
    """The layer's kept mma GEMV launch for M rows of `dtype` activations with `params` (default: the
    dispatch's choice for an eager or, with `graphed`, a CUDA-graph call), made at the first call; None
    where the mma GEMV does not run it (M > 64, a dtype or layout it does not take, or the dispatch
    chooses another kernel). Kept on the kernel weights, so a layer moved to another device, whose
    kernel weights are rebuilt, starts afresh; remade if the bias tensor changes."""
    if not isinstance(kw, MmaWeights) or m > 64:
        return None
    launches = kw.__dict__.setdefault("launches", {})
    key = (m, dtype, graphed) if params is None else (m, dtype, tuple(sorted(params.items())))
    launch = launches.get(key)
    if launch is None or (launch and launch.bias is not bias):
        if params is None:
            choice = choice_for(kw, m, device, dtype, graphed)
            params = choice.params if choice.method == "mma" else None
        launch = False
        groups = kw.scales.shape[1]
        if params is not None and triton_mma.supports(kw.bits, kw.group_size, kw.in_features, groups, dtype):
            launch = triton_mma.GemvLaunch(kw, bias, m, device, bf16=dtype == torch.bfloat16, **params)
        launches[key] = launch
    return launch or None


def quant_linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """y = x Wᵀ + b for a QuantLinear-like layer, on the kernel chosen for its layout, bits and M."""
    kw = kernel_weights(layer, x.device, dtype=x.dtype)
    shape = x.shape
    x2d = x.reshape(-1, shape[-1])
    # the capture state only matters where the Gluon GEMM can be chosen (M > 16); asking costs host time
    graphed = x2d.shape[0] > 16 and capturing(x.device)
    launch = gemv_launch(kw, layer.bias, x2d.shape[0], x2d.dtype, x.device, graphed=graphed)
    if launch is not None:
        y = launch(x2d)
    else:
        y = run(x2d, kw, layer.bias, choice_for(kw, x2d.shape[0], x.device, x2d.dtype, graphed))
    return y.reshape(*shape[:-1], kw.out_features)
