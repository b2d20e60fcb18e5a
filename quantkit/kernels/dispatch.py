"""Which kernel runs a quantized linear: one measured table (dispatch_table.py) and one rule to pick from it.

`quant_linear(x, layer)` is what `QuantLinear.forward` calls on the Triton path. The layer's packed
buffers are repacked once into a kernel layout, kept on the layer and rebuilt if it moves to another
device: the mma layout on an sm_80+ NVIDIA GPU for layers the tensor-core GEMV takes (the GEMV, the
Gluon GEMM on Hopper with fp16 activations, dequantize + cuBLAS), else the block-planar one (the
split-K GEMV and GEMM of triton_gemv / triton_gemm, dequantize + cuBLAS; also under the Triton
interpreter, which cannot run the mma kernels' inline PTX).

The rule (`choose`): among the rows of the layer's class, the first whose M bound is ≥ M, skipping
Gluon rows where the GEMM may not run: not on this GPU or dtype, turned off in the layer's
KernelSettings (settings.py), or an eager call with M ≤ EAGER_GEMV_MAX_M (`choice_for`). The settings
may replace rows of the table (`dispatch_table.replaced_rows`; `bench/kernel_speed.py --tune` writes
them). Each layer keeps
its GEMV launches per M and dtype (`gemv_launch`), which skip Triton's argument binding after the first.
"""

from __future__ import annotations

import torch
import triton

from quantkit.kernels import gluon_gemm, triton_gemm, triton_gemv, triton_mma
from quantkit.kernels.capture import capturing
from quantkit.kernels.dispatch_table import TABLE, Choice, width_class
from quantkit.kernels.settings import AUTO, KernelSettings
from quantkit.kernels.hardware import mma_capable
from quantkit.kernels.launch import interpreted
from quantkit.kernels.triton_layout import KernelWeights, from_module
from quantkit.kernels.triton_mma import MmaWeights

# Up to this M an eager call takes the mma GEMV even where the Gluon GEMM is faster on the GPU: an eager Gluon
# call costs more host time (two launches, a TMA descriptor) than its GPU time, so back to back the GEMV
# is faster (bench/KERNELS_NOTES.md). From a CUDA graph, and above this M either way, the GEMM is faster.
EAGER_GEMV_MAX_M = 64


def choose(bits: int, m: int, cls: str = "block-planar", gluon: bool = False, table: dict = TABLE) -> Choice:
    """The table's kernel for M rows of x on a `bits`-bit layer of class `cls`: the first row whose M bound
    is ≥ M, Gluon rows only with `gluon`; the last row takes any larger M."""
    rows = table[f"w{bits} {cls}"]
    for bound, choice in rows:
        if m <= bound and (gluon or choice.method != "gluon"):
            return choice
    return rows[-1][1]


def mma_choice(bits: int, m: int, n: int, sms: int = 132, pdl: bool = True, k: int = 0,
               gluon: bool = False, table: dict = TABLE) -> Choice:
    """The table's kernel for a mma-layout layer of N outputs and K inputs on a GPU with `sms` SMs; `pdl`:
    the GPU launches with programmatic dependent launch; `gluon`: the Gluon GEMM may run."""
    c = choose(bits, m, width_class(n, k, sms), gluon, table)
    if pdl or not c.params.get("pdl"):
        return c
    return Choice(c.method, {key: v for key, v in c.params.items() if key not in ("pdl", "prefetch")}, c.programs)


def gluon_choice(m: int, n: int, k: int, sms: int = 132, bits: int = 4) -> Choice | None:
    """The Gluon GEMM's row for this layer and M, or None where the table runs another kernel."""
    c = mma_choice(bits, m, n, sms, True, k, gluon=True)
    return c if c.method == "gluon" else None


def choice_for(kw: KernelWeights | MmaWeights, m: int, device: torch.device, dtype: torch.dtype = torch.float16,
               graphed: bool | None = None, kernels: KernelSettings = AUTO) -> Choice:
    """The kernel for these weights and M rows of `dtype` x; graphed: whether the call will run from a
    CUDA graph (None: whether the stream is capturing now). The Gluon GEMM may run where this GPU and
    dtype take it, unless `kernels` turns it off, and for an eager call only above EAGER_GEMV_MAX_M."""
    table = kernels.dispatch_rows()
    if not isinstance(kw, MmaWeights):
        return choose(kw.bits, m, table=table)
    if graphed is None:
        graphed = capturing(device)
    gluon = kernels.gluon and (graphed or m > EAGER_GEMV_MAX_M) and gluon_gemm.supports(kw, dtype, device)
    return mma_choice(kw.bits, m, kw.out_features, _sm_count(device), _has_pdl(device, kernels), kw.in_features,
                      gluon, table)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the Triton interpreter on the CPU: keep some split-K in play so CI exercises it


def _has_pdl(device: torch.device, kernels: KernelSettings) -> bool:
    """Programmatic dependent launch (sm_90+), only where `kernels.pdl` asks for it: faster back to back at
    small M, but not in the graphed decode step, where the GEMV follows kernels that never trigger early
    (bench/KERNELS_NOTES.md)."""
    if not kernels.pdl or device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def takes_mma_layout(kw: KernelWeights, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a layer gets the mma layout: an NVIDIA GPU of compute capability 8.0 or later
    (hardware.mma_capable; others reach this module only with KernelSettings(path="triton")), not the Triton
    interpreter, and a layer and activation dtype the GEMV takes."""
    return (device.type == "cuda" and not interpreted() and mma_capable(device)
            and triton_mma.supports(kw.bits, kw.group_size, kw.in_features, kw.scales.shape[1], dtype))


def split_k_for(tiles: int, k_steps: int, device: torch.device, programs_per_sm: float) -> int:
    """Split K until the launch has about `programs_per_sm` programs per SM (at most 16, ≥ 2 steps each)."""
    want = programs_per_sm * _sm_count(device)
    split = 1
    while split < 16 and tiles * split * 2 <= want and k_steps >= 4 * split:
        split *= 2
    return split


def kernel_weights(layer: torch.nn.Module, device: torch.device | None = None, offload: bool | None = None,
                   dtype: torch.dtype = torch.float16) -> KernelWeights | MmaWeights:
    """The layer's weights in its kernel layout on `device`, made at the first call and kept on the layer.
    With `offload` (default: on CUDA) the checkpoint tensors then move to host memory: the state dict
    stays complete and the reference path still works, while the accelerator holds one copy."""
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


def run(x2d: torch.Tensor, kw: KernelWeights | MmaWeights, bias: torch.Tensor | None, choice: Choice,
        kernels: KernelSettings = AUTO) -> torch.Tensor:
    """y [M, N] for x [M, K] with the given choice (which must suit the layout of `kw`)."""
    m, n, p = x2d.shape[0], kw.out_features, choice.params
    if choice.method == "dequant+cublas":
        w = (triton_mma if isinstance(kw, MmaWeights) else triton_gemm).dequantize(kw, x2d.dtype)
        return torch.nn.functional.linear(x2d, w, None if bias is None else bias.to(x2d.dtype))
    if choice.method == "gluon":
        if isinstance(kw, MmaWeights) and gluon_gemm.supports(kw, x2d.dtype, x2d.device):
            y = gluon_gemm.gemm(x2d, kw, bias, **p)
            if y is not None:
                return y
        # e.g. bf16 x, or a capture whose warm-up ran another kernel (the Gluon one would load a module)
        return run(x2d, kw, bias, mma_choice(kw.bits, m, n, _sm_count(x2d.device), _has_pdl(x2d.device, kernels),
                                             kw.in_features, table=kernels.dispatch_rows()), kernels)
    if choice.method == "mma":
        launch = gemv_launch(kw, bias, m, x2d.dtype, x2d.device, p)
        if launch is not None:
            return launch(x2d)
        dtype = x2d.dtype
        if not triton_mma.supports(kw.bits, kw.group_size, kw.in_features, kw.scales.shape[1], dtype):
            x2d = x2d.half()  # e.g. bf16 activations with 8-bit weights: fp16 operands, fp32 sums
        out = torch.empty(m, n, dtype=x2d.dtype, device=x2d.device)
        for r in range(0, m, 64):  # at most 64 rows of x per launch (8 per column tile of the B operand)
            triton_mma.gemv(x2d[r:r + 64], kw, bias, out=out[r:r + 64], **p)
        return out.to(dtype)
    k_steps = triton.cdiv(kw.qweight.shape[1], 4 * p["blocks"])
    if choice.method == "gemv":
        split = split_k_for(m * triton.cdiv(n, p["block_n"]), k_steps, x2d.device, choice.programs)
        return triton_gemv.gemv(x2d, kw, bias, split_k=split, **p)
    tiles = triton.cdiv(m, p["block_m"]) * triton.cdiv(n, p["block_n"])
    return triton_gemm.gemm(x2d, kw, bias, split_k=split_k_for(tiles, k_steps, x2d.device, choice.programs), **p)


def gemv_launch(kw: KernelWeights | MmaWeights, bias: torch.Tensor | None, m: int, dtype: torch.dtype,
                device: torch.device, params: dict | None = None, graphed: bool = False,
                kernels: KernelSettings = AUTO) -> triton_mma.GemvLaunch | None:
    """The layer's kept mma GEMV launch for M rows of `dtype` x with `params` (default: the dispatch's
    choice for an eager or, with `graphed`, a CUDA-graph call), made at the first call; None where the mma
    GEMV does not run it (M > 64, a dtype or layout it does not take, or another kernel is chosen). Kept
    on the kernel weights (a layer moved to another device starts afresh); remade if the bias changes."""
    if not isinstance(kw, MmaWeights) or m > 64:
        return None
    launches = kw.__dict__.setdefault("launches", {})
    key = (m, dtype, graphed) if params is None else (m, dtype, tuple(sorted(params.items())))
    launch = launches.get(key)
    if launch is None or (launch and launch.bias is not bias):
        if params is None:
            choice = choice_for(kw, m, device, dtype, graphed, kernels)
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
    kernels = layer.kernels
    launch = gemv_launch(kw, layer.bias, x2d.shape[0], x2d.dtype, x.device, graphed=graphed, kernels=kernels)
    if launch is not None:
        y = launch(x2d)
    else:
        y = run(x2d, kw, layer.bias, choice_for(kw, x2d.shape[0], x.device, x2d.dtype, graphed, kernels), kernels)
    return y.reshape(*shape[:-1], kw.out_features)
