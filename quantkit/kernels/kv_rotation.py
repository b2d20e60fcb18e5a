"""An orthogonal rotation of each KV head's channels before the paged pool codes K and V.

Per-token int4 codes give a token one step for all its channels, and a few outlier key channels (far
larger than the rest, common after RoPE) set that step: the other channels keep one or two codes. A
Hadamard matrix mixes every channel into every other, so the rotated row's range shrinks toward its
norm and each code carries information (QuaRot, SpinQuant). Attention is unchanged: q gets the same
rotation (q·k = qR·kR when R·Rᵀ = I), and v's rotation is undone on attention's output, a weighted sum
of V rows (Σ p·vR = (Σ p·v)·R).

The matrices are a Sylvester Hadamard matrix S (entries ±1, S·S = n·I, symmetric) times powers of two
whose product is 1/n: K and V take S·2^-⌊m/2⌋, q and the output S·2^-⌈m/2⌉ (n = 2^m). Every entry is
exact in fp16 and bf16, so a rotation and its inverse cost only the rounding of the matmuls' results.
A head_dim that is not a power of two is rotated in blocks of its largest power-of-two divisor (a
block-diagonal matrix), which spreads an outlier only within its block.

Plain matmuls on the step's own tensors: no host syncs, nothing sized by the step, so CUDA graphs and
the piecewise prefill graphs capture them like any other op.
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

    kv: Tensor  # K and V are multiplied by it before they are written
    q: Tensor  # q is multiplied by it, and so is attention's output to return from V's basis

    @staticmethod
    def hadamard(head_dim: int, dtype: torch.dtype, device: torch.device | str) -> "KVRotation":
        block = head_dim & -head_dim  # the largest power of two dividing head_dim
        if block < head_dim:
            log.info("head_dim %d is not a power of two: KV rotated in %d blocks of %d channels",
                     head_dim, head_dim // block, block)
        s = torch.block_diag(*[hadamard(block)] * (head_dim // block))
        m = block.bit_length() - 1
        return KVRotation((s * 2.0 ** -(m // 2)).to(dtype=dtype, device=device),
                          (s * 2.0 ** -(m - m // 2)).to(dtype=dtype, device=device))

    def rotate(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [T, heads, D], k and v [T, kv_heads, D] in the pool's basis."""
        return q @ self.q, k @ self.kv, v @ self.kv

    def unrotate(self, out: Tensor) -> Tensor:
        """Attention's output [T, heads, D] over rotated V, back in the model's basis."""
        return out @ self.q
