"""The torch reference of the quantized linears: W dequantized from packed tensors (y = x Wᵀ + b then).

They consume the two packed layouts the loader holds (their word packing: quantkit.packing):
- "awq": qweight int32 [in, out/8] with nibble i of each word holding column packing.AWQ_ORDER[i]
  of its block of eight, qzeros int32 [groups, out/8] likewise, scales [groups, out].
- "packed": weight_packed int32 [out, ceil(in·b/32)] with values packed sequentially along the
  input dimension, scales [out, groups], zero points packed sequentially along the output dimension.
Both mean W = (q − z) · s with unsigned q and z.
"""

from __future__ import annotations

import torch

from quantkit.packing import AWQ_ORDER, E4M3_MAX, FP8_MIN_SCALE, dequantize_fp8, encode_e4m3, unpack_words  # noqa: F401


def awq_ints(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [rows, cols/8] → int32 [rows, cols] in column order."""
    return unpack_words(packed, 4, packed.shape[1] * 8, AWQ_ORDER)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [out, in] in float32 from the AWQ gemm tensors."""
    q = awq_ints(qweight)  # [in, out]
    z = awq_ints(qzeros).repeat_interleave(group_size, dim=0)
    s = scales.repeat_interleave(group_size, dim=0)
    return ((q - z).float() * s.float()).t()


def packed_zero_points(weight_zero_point: torch.Tensor | None, weight_scale: torch.Tensor, bits: int,
                       out_features: int) -> torch.Tensor:
    """Zero points int32 [out, groups]: unpacked along the output dimension, or 2^(b−1) when symmetric."""
    if weight_zero_point is None:
        return torch.full(weight_scale.shape, 2 ** (bits - 1), dtype=torch.int32, device=weight_scale.device)
    return unpack_words(weight_zero_point.t().contiguous(), bits, out_features).t()


def dequantize_packed(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    out_features: int,
    in_features: int,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """W [out, in] in float32 from pack-quantized tensors (zero 2^(b−1) when symmetric)."""
    q = unpack_words(weight_packed, bits, in_features)
    z = packed_zero_points(weight_zero_point, weight_scale, bits, out_features).repeat_interleave(group_size, dim=1)
    s = weight_scale.repeat_interleave(group_size, dim=1)
    return (q - z).float() * s.float()


# FP8 (e4m3) W8A8, compressed-tensors float-quantized: what the GPU's scaled matrix product computes, by
# plain torch ops (the emulation the CPU runs, and the oracle of any FP8 kernel).


def fp8_activation_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-token scales [..., 1], float32: each token's largest |x| / 448 (floored at FP8_MIN_SCALE), divided
    exactly: by a tensor, since CUDA torch turns a division by a Python number into a product with its
    reciprocal (one bit off at times; the Triton kernels divide correctly rounded)."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    return (amax / amax.new_full((), E4M3_MAX)).clamp_min(FP8_MIN_SCALE)


def quantize_fp8(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x on the e4m3 grid, its scale): per token [..., 1] when `input_scale` is None, else `input_scale`."""
    scale = fp8_activation_scale(x) if input_scale is None else input_scale.reshape(1).float()
    return encode_e4m3(x, scale), scale
