"""Which kernel runs a quantized linear: chosen by bits and M from a table measured on the H200.

`quant_linear(x, layer)` is what `QuantLinear.forward` calls on the Triton path. The layer's packed
buffers are repacked once into the kernel layout (triton_layout) and kept on the layer as a plain
attribute, rebuilt if the layer moves to another device. The table below came from
bench/kernels_sweep.py (figures and reasons in BENCHMARKS.md, "Kernels (H200)"); split-K is set
per call so that a launch has enough programs to fill the GPU. QUANTKIT_DISPATCH_TABLE=path.json
replaces the table (the format `use_table` takes).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

from quantkit.kernels import triton_gemm, triton_gemv
from quantkit.kernels.triton_layout import KernelWeights, from_module


@dataclass(frozen=True)
class Choice:
    """A kernel and its tile parameters; `programs` is the split-K target in programs per SM."""

    method: str  # "gemv", "gemm" or "dequant+cublas"
    params: dict = field(default_factory=dict)
    programs: float = 4.0


def _gemv(block_n: int, blocks: int, num_warps: int, programs: float, num_stages: int = 1) -> Choice:
    return Choice("gemv", dict(block_n=block_n, blocks=blocks, num_warps=num_warps, num_stages=num_stages), programs)


def _gemm(block_m: int, block_n: int, programs: float) -> Choice:
    return Choice("gemm", dict(block_m=block_m, block_n=block_n, blocks=8, num_warps=4, num_stages=3, swap_ab=True),
                  programs)


_CUBLAS = Choice("dequant+cublas")
# bits → rows of (largest M, choice); the first row whose bound is ≥ M is used. Measured on the H200
# by `bench/kernel_speed.py --tune` (least time summed over the four Llama-2-7B linears, per M; run 5 of
# 2026-11-30 in bench/KERNELS_NOTES.md). From M = 64 (W4) and beyond M = 16 (W8) every fused kernel
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
    """Replace the table, e.g. with one that bench/kernel_speed.py --tune measured on another GPU.

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


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the Triton interpreter on the CPU: keep some split-K in play so CI exercises it


def split_k_for(tiles: int, k_steps: int, device: torch.device, programs_per_sm: float) -> int:
    """Split K until the launch has about `programs_per_sm` programs per SM (at most 16, ≥ 2 steps each)."""
    want = programs_per_sm * _sm_count(device)
    split = 1
    while split < 16 and tiles * split * 2 <= want and k_steps >= 4 * split:
        split *= 2
    return split


def kernel_weights(layer: torch.nn.Module, device: torch.device | None = None, offload: bool | None = None) -> KernelWeights:
    """The layer's weights in the kernel layout on `device`, made at the first call and kept on the layer.

    The kernel layout holds the same bytes as the checkpoint tensors, so keeping both would double the
    weight memory. With `offload` (default: on CUDA) the checkpoint tensors move to host memory once the
    kernel layout exists: the state dict stays complete and the reference path still works (it
    dequantizes on the host), while the accelerator holds one copy of the weight.
    """
    ref = layer.qweight if layer.layout == "awq" else layer.weight_packed
    device = ref.device if device is None else device
    offload = device.type == "cuda" if offload is None else offload
    kw = getattr(layer, "_kernel_weights", None)
    if kw is None or kw.qweight.device != device:
        if ref.device != device:  # the checkpoint tensors were offloaded: repack them on `device`
            layer.to(device)
        kw = from_module(layer)
        layer._kernel_weights = kw
        if offload:
            layer.offload_checkpoint_tensors()
    return kw


def run(x2d: torch.Tensor, kw: KernelWeights, bias: torch.Tensor | None, choice: Choice) -> torch.Tensor:
    """y [M, N] for x [M, K] with the given choice."""
    m = x2d.shape[0]
    n, k8 = kw.out_features, kw.qweight.shape[1]
    if choice.method == "dequant+cublas":
        w = triton_gemm.dequantize(kw, x2d.dtype)
        return torch.nn.functional.linear(x2d, w, None if bias is None else bias.to(x2d.dtype))
    p = choice.params
    if choice.method == "gemv":
        tiles = m * triton.cdiv(n, p["block_n"])
        split = split_k_for(tiles, triton.cdiv(k8, 4 * p["blocks"]), x2d.device, choice.programs)
        return triton_gemv.gemv(x2d, kw, bias, split_k=split, **p)
    tiles = triton.cdiv(m, p["block_m"]) * triton.cdiv(n, p["block_n"])
    split = split_k_for(tiles, triton.cdiv(k8, 4 * p["blocks"]), x2d.device, choice.programs)
    return triton_gemm.gemm(x2d, kw, bias, split_k=split, **p)


def quant_linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """y = x Wᵀ + b for a QuantLinear-like layer, on the kernel the table picks for its bits and M."""
    kw = kernel_weights(layer, x.device)
    shape = x.shape
    x2d = x.reshape(-1, shape[-1])
    bias = None if layer.bias is None else layer.bias
    y = run(x2d, kw, bias, choose(kw.bits, x2d.shape[0]))
    return y.reshape(*shape[:-1], kw.out_features)
