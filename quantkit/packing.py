"""The number encodings of the on-disk layouts — small integers packed into int32 words, and float8 e4m3
values under a scale — shared by the formats that write and read checkpoints and the kernels' torch
reference that computes with them (both sit on the lowest floor, beside config.py, and import this).

A word holds 32/b values of b bits; value i sits in bits b·i … b·i+b−1. In sequence, value i is column i
of the word's run of columns; AutoAWQ's "gemm" layout instead puts column AWQ_ORDER[i] in value i.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ gemm word holds column AWQ_ORDER[i] of its eight


def pack_words(values: torch.Tensor, bits: int, order: Optional[Sequence[int]] = None) -> torch.Tensor:
    """[rows, n] ints in 0..2^b−1 → int32 [rows, ceil(n·b/32)], zero padded: value i of a word in bits
    b·i … b·i+b−1 holds column order[i] of its run of 32/b columns (in sequence without `order`)."""
    per_word = 32 // bits
    rows, n = values.shape
    words = -(-n // per_word)
    v = torch.zeros(rows, words * per_word, dtype=torch.int64, device=values.device)
    v[:, :n] = values.to(torch.int64)
    v = v.reshape(rows, words, per_word)
    if order is not None:
        v = v[:, :, list(order)]
    shifts = torch.arange(0, bits * per_word, bits, dtype=torch.int64, device=v.device)
    packed = (v << shifts).sum(dim=-1)
    # Words ≥ 2^31 wrap to negative int32, which is what the consumers read back.
    return (packed - (packed >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def unpack_words(packed: torch.Tensor, bits: int, n: int, order: Optional[Sequence[int]] = None) -> torch.Tensor:
    """int32 [rows, words] → int32 [rows, n], undoing `pack_words` with the same `order`."""
    per_word = 32 // bits
    shifts = torch.arange(0, bits * per_word, bits, dtype=torch.int32, device=packed.device)
    v = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)
    if order is not None:  # column j of a run sits in value order.index(j)
        v = v[:, :, [list(order).index(j) for j in range(per_word)]]
    return v.reshape(packed.shape[0], -1)[:, :n]


E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448: an absmax maps onto it
# The smallest FP8 scale, vLLM's floor (448 · 512)⁻¹: an all-zero row or token still divides by a positive
# number (vLLM reads a scale ≤ 0 as absent).
FP8_MIN_SCALE = 1.0 / (E4M3_MAX * 512.0)


def encode_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to the nearest e4m3 value (saturated at ±448: the cast itself makes NaN there)."""
    return (x.float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """W [out, in] in float32: float(weight) · weight_scale (per channel [out, 1] or per tensor [1])."""
    scale = weight_scale.float()
    return weight.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(1, 1))
