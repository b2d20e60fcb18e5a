"""The layout the Triton kernels read: the loader's packed weights, repacked once per layer.

Both on-disk layouts (AWQ gemm and compressed-tensors pack-quantized) become one layout:
- ``qweight`` int32 [N, K8] "block-planar": K is cut into blocks of 4 words (4·32/b inputs); within
  block ``blk``, value ``j`` of word ``w`` (bits b·j … b·j+b−1) holds input k = blk·4·(32/b) + 4·j + w.
  A kernel that splits a tile of words into its 32/b bit planes then meets, for each plane, runs of
  four consecutive inputs: x loads stay vectorised and no value needs moving between lanes.
- ``scales`` fp16 [N, G] and ``zeros`` uint8 [N, G] (2^(b−1) when the checkpoint is symmetric).
K8 is padded to a multiple of 4 words with zero words; kernels mask x beyond K, so the pad reads as 0.
W = (q − z) · s as in the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from quantkit.kernels.reference import awq_ints, packed_zero_points
from quantkit.packing import unpack_words

BLOCK_WORDS = 4
# Output rows repacked at a time. Repacking goes through int64 temporaries (8 bytes per weight, several
# alive at once): whole layers took 2.5 GB of transient memory for a 22016 × 4096 one (45 MB packed),
# 1024 rows keep it to tens of MB. A multiple of 64, so that chunks of the mma layout's row tiles join.
ROW_CHUNK = 1024


def by_rows(n: int, pack: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """pack(r0, r1) for each chunk [r0, r1) of ROW_CHUNK rows of n, concatenated along rows."""
    return torch.cat([pack(r0, min(r0 + ROW_CHUNK, n)) for r0 in range(0, n, ROW_CHUNK)])


@dataclass
class PackedWeights:
    """One layer's weights repacked for a kernel: integer words, fp16 scales [N, G], uint8 zeros [N, G]."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    in_features: int
    out_features: int

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads for the weight: packed integers, scales and zeros."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))


class KernelWeights(PackedWeights):
    """One layer's weights in the block-planar layout (see the module docstring)."""


def pack_block_planar(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers q [N, K] in 0..2^b−1 → int32 [N, K8] in the block-planar layout."""
    return by_rows(q.shape[0], lambda r0, r1: _pack_block_planar_rows(q[r0:r1], bits))


def _pack_block_planar_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    per_word = 32 // bits
    block = BLOCK_WORDS * per_word
    n, k = q.shape
    kp = -(-k // block) * block
    v = torch.zeros(n, kp, dtype=torch.int64, device=q.device)
    v[:, :k] = q.to(torch.int64)
    # [N, blocks, plane j, word w] → [N, blocks, w, j]: plane j of word w is k = 4j + w in its block.
    v = v.reshape(n, kp // block, per_word, BLOCK_WORDS).transpose(2, 3)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=q.device)
    words = (v << shifts).sum(dim=-1)
    words = words - (words >= 2**31).to(torch.int64) * 2**32
    return words.to(torch.int32).reshape(n, -1).contiguous()


def unpack_block_planar(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """The inverse of `pack_block_planar` (for tests): int32 [N, K]."""
    per_word = 32 // bits
    n = qweight.shape[0]
    v = unpack_words(qweight, bits, qweight.shape[1] * per_word)
    v = v.reshape(n, -1, BLOCK_WORDS, per_word).transpose(2, 3).reshape(n, -1)
    return v[:, :k]


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> KernelWeights:
    """Kernel layout from AutoAWQ gemm tensors (4-bit)."""
    k, n = qweight.shape[0], scales.shape[1]
    z = awq_ints(qzeros).t()  # [N, G]
    return KernelWeights(  # output rows r0…r1 are AWQ columns, 8 per word
        qweight=by_rows(n, lambda r0, r1: _pack_block_planar_rows(awq_ints(qweight[:, r0 // 8:-(-r1 // 8)]).t(), 4)),
        scales=scales.t().contiguous().to(torch.float16),
        zeros=z.to(torch.uint8).contiguous(),
        bits=4, group_size=group_size, in_features=k, out_features=n,
    )


def from_packed(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    out_features: int,
    in_features: int,
    bits: int,
    group_size: int,
) -> KernelWeights:
    """Kernel layout from compressed-tensors pack-quantized tensors (4 or 8 bits)."""
    z = packed_zero_points(weight_zero_point, weight_scale, bits, out_features).to(torch.uint8)
    return KernelWeights(
        qweight=by_rows(out_features, lambda r0, r1: _pack_block_planar_rows(unpack_words(weight_packed[r0:r1], bits,
                                                                                      in_features), bits)),
        scales=weight_scale.to(torch.float16).contiguous(),
        zeros=z.contiguous(),
        bits=bits, group_size=group_size, in_features=in_features, out_features=out_features,
    )


def from_module(layer: torch.nn.Module) -> KernelWeights:
    """Kernel layout from a QuantLinear-like module (duck-typed: kernels know nothing of nn/)."""
    if layer.layout == "awq":
        return from_awq(layer.qweight, layer.qzeros, layer.scales, layer.group_size)
    return from_packed(
        layer.weight_packed, layer.weight_scale, layer.weight_zero_point,
        layer.out_features, layer.in_features, layer.bits, layer.group_size,
    )
