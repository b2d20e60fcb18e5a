"""How a KV4 pool stores keys: centred, then rotated by a Hadamard matrix, before the per-token codes.

Per-token int4 codes give a token one step for all its channels, and a few outlier key channels (far
larger than the rest, most of it a fixed offset, common after RoPE) set that step: the other channels
keep one or two codes. Two exact transformations of attention take the outliers out of the codes:

- centring: every key is shifted by a fixed per-channel vector μ (each channel's calibrated mean, where
  the checkpoint has KV statistics: engine/kv_scales.key_centers). A query's scores all move by the same
  q·μ, which softmax ignores, while the codes no longer span the offset.
- rotation: a Hadamard matrix mixes every channel into every other, so a rotated key's range shrinks
  toward its norm and each code carries information (QuaRot, SpinQuant). q gets the same rotation,
  and q·k = qR·kR when R·Rᵀ = I.

Values are left alone: their per-token int4 codes cost a fraction of what the keys' do (BENCHMARKS.md,
"One KV quantizer"), and a rotation of V would have to be undone on attention's output.

The matrices are a Sylvester Hadamard matrix S (entries ±1, S·S = n·I, symmetric) times powers of two
whose product is 1/n: keys take S·2^-⌊m/2⌋, queries S·2^-⌈m/2⌉ (n = 2^m). Every entry is exact in fp16
and bf16, so scores change only by the rounding of the matmuls' results. A head_dim that is not a power
of two is rotated in blocks of its largest power-of-two divisor (a block-diagonal matrix), which
spreads an outlier only within its block.

Plain tensor ops on the step's own tensors: no host syncs, nothing sized by the step, so CUDA graphs and
the piecewise prefill graphs capture them like any other op. The kernels read and write the pool as
they always do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from quantkit.config import UserError

log = logging.getLogger(__name__)


def hadamard(n: int) -> Tensor:
    """Sylvester's ±1 Hadamard matrix of order n (a power of two), float32."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of two, not {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def resolve_rotation(name: Optional[str], bits: int, static: bool = False) -> str:
    """"hadamard" or "none" for the setting `name` (None as "auto") of a pool of `bits`, with `static`
    scales or online ones. Static scales were calibrated on unrotated K and V: they refuse a rotation."""
    name = name or "auto"
    if name not in ("auto", "hadamard", "none"):  # EngineConfig refuses other values with a user's sentence
        raise ValueError(f"unknown KV rotation {name!r}")
    if name == "auto":
        return "hadamard" if bits == 4 and not static else "none"
    if name == "hadamard" and static:
        raise UserError("--kv-rotation hadamard rotates K and V, but static KV scales were calibrated on them "
                        "unrotated: use --kv-scales online with it, or --kv-rotation none")
    return name


def pool_rotation(name: Optional[str], bits: int, static: bool, head_dim: int, dtype: torch.dtype,
                  device: torch.device | str) -> Optional["KVRotation"]:
    """The rotation a pool applies (None: none), from its setting (see `resolve_rotation`)."""
    if resolve_rotation(name, bits, static) == "none":
        return None
    return KVRotation.hadamard(head_dim, dtype, device)


@dataclass(frozen=True)
class KVRotation:
    """The two scaled block-Hadamard matrices [head_dim, head_dim] of a pool (see the module docstring)."""

    q: Tensor  # queries are multiplied by it
    k: Tensor  # keys are multiplied by it before they are written

    @staticmethod
    def hadamard(head_dim: int, dtype: torch.dtype, device: torch.device | str) -> "KVRotation":
        block = head_dim & -head_dim  # the largest power of two dividing head_dim
        if block < head_dim:
            log.info("head_dim %d is not a power of two: keys rotated in %d blocks of %d channels",
                     head_dim, head_dim // block, block)
        s = torch.block_diag(*[hadamard(block)] * (head_dim // block))
        m = block.bit_length() - 1
        return KVRotation((s * 2.0 ** -(m - m // 2)).to(dtype=dtype, device=device),
                          (s * 2.0 ** -(m // 2)).to(dtype=dtype, device=device))

    def rotate(self, q: Tensor, k: Tensor, k_center: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """q [T, heads, D] and k [T, kv_heads, D] in the pool's basis, k first shifted by `k_center`
        [kv_heads, D] (None: not shifted)."""
        if k_center is not None:
            k = k - k_center
        return q @ self.q, k @ self.k
