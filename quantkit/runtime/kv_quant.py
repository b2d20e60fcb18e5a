"""Integer KV-cache codes: asymmetric int8 / int4 with an integer zero point.

A code is q = clamp(round(x / s) + z, 0, 2^b − 1) and reads back as (q − z) · s. The range always
includes 0 (so z is an integer in [0, 2^b − 1] that fits the code's own dtype), which costs nothing
for K and V rows: they straddle 0. Online codes keep one fp16 scale and one uint8 zero per token per
head (3 bytes, against lmdeploy's 4 for fp scale + fp zero: with head_dim 64 that is what keeps KV8
under 0.53× of fp16). Int4 codes are packed two per byte along head_dim, low nibble first.
"""

from __future__ import annotations

import torch

QMAX = {8: 255, 4: 15}
# The smallest normal fp16 number: smaller scales would lose relative precision as subnormals.
_MIN_SCALE = 2.0**-14


def check_bits(bits: int) -> int:
    if bits not in QMAX:
        raise ValueError(f"KV codes are 8 or 4 bits, not {bits}")
    return QMAX[bits]


def range_params(mn: torch.Tensor, mx: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (fp16 values, held in float32) and integer zero (float32) covering [min(mn,0), max(mx,0)].

    The scale is rounded *up* to fp16 so that the stored scale still spans the whole range: the
    round-trip error then stays within half a step, with no clipping at either end.
    """
    qmax = check_bits(bits)
    lo, hi = mn.float().clamp(max=0), mx.float().clamp(min=0)
    # A tensor divisor: CUDA turns division by a host scalar into a multiplication by its reciprocal.
    scale = torch.div(hi - lo, torch.full_like(hi, qmax)).clamp_min(_MIN_SCALE)
    # fp16 has 10 mantissa bits: growing by 2^-10 before rounding to nearest can never round below.
    scale = (scale * (1 + 2.0**-10)).half().float()
    zero = torch.round(-lo / scale).clamp(0, qmax)
    return scale, zero


def encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of `x` under broadcastable `scale` and `zero`; values outside the range are clipped."""
    qmax = check_bits(bits)
    return (torch.round(x.float() / scale) + zero).clamp_(0, qmax).to(torch.uint8)


def decode(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q − zero) · scale in `dtype`."""
    return ((q.float() - zero.float()) * scale.float()).to(dtype)


def quantize_per_token(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes of `x` [..., D] with one scale and zero per row: (q uint8, scale fp16 [...,1], zero uint8 [...,1])."""
    scale, zero = range_params(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), bits)
    return encode(x, scale, zero, bits), scale.half(), zero.to(torch.uint8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim (which must be even): low nibble = even index."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last dimension, not {q.shape[-1]}")
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`."""
    return torch.stack((p & 0x0F, p >> 4), dim=-1).flatten(-2)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_int4(q) if bits == 4 else q


def unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_int4(p) if bits == 4 else p
