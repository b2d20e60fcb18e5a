"""Which accelerators quantkit's Triton kernels are for: NVIDIA GPUs of compute capability 8.0 or later.

The tensor-core GEMV (triton_mma) is inline PTX around `mma.sync` m16n8k16 on fp16/bf16 operands,
which NVIDIA added in sm_80, and Triton itself supports NVIDIA GPUs from 8.0. Elsewhere (ROCm, Volta,
Turing) quantized linears take the dequantize path: the torch reference (quantkit.kernels.reference)
dequantizes the weight and calls the platform's matrix product. The first refusal of each kind is logged.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

MIN_CAPABILITY = (8, 0)

def mma_capable(device: torch.device) -> bool:
    """Whether `device` runs the Triton kernels and the tensor-core GEMV: an NVIDIA GPU of compute
    capability 8.0 or later (not ROCm, where torch.version.hip is set)."""
    if device.type != "cuda":
        return False
    return device_capable(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def device_capable(index: int) -> bool:
    """`mma_capable` for CUDA device `index`: asked once per device and process, a refusal logged then."""
    if torch.version.hip is not None:
        why = f"ROCm (HIP {torch.version.hip})"
    else:
        capability = tuple(torch.cuda.get_device_capability(index))
        if capability >= MIN_CAPABILITY:
            return True
        why = f"compute capability {capability[0]}.{capability[1]}"
    log.warning("quantized linears on cuda:%d, %s: the Triton kernels need an NVIDIA GPU of compute "
                "capability 8.0 or later; using the dequantize path (torch reference)", index, why)
    return False



FP8_CAPABILITY = (8, 9)  # Ada and Hopper: e4m3 tensor-core MMAs and conversions


def fp8_kernels(device: torch.device) -> bool:
    """Whether the FP8 Triton kernels (kernels/triton_fp8.py) run for tensors on `device`, given that the
    Triton path does: a GPU of compute capability 8.9 or later, or the CPU (the Triton interpreter)."""
    if device.type != "cuda":
        return True
    if torch.version.hip is not None:
        return False
    return tuple(torch.cuda.get_device_capability(device)) >= FP8_CAPABILITY
