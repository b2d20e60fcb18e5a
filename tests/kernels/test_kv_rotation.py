"""kernels/kv_rotation.py against float64 math: the two matrices undo each other exactly in every dtype
the engine runs, they mix every channel of a block into every other, and pools pick them as documented."""

from __future__ import annotations

import pytest
import torch

from quantkit.config import UserError
from quantkit.kernels.kv_rotation import KVRotation, hadamard
from quantkit.kernels.paged_kv import PagedKV


def test_sylvester_matrix_is_a_hadamard_matrix():
    for n in (1, 2, 8, 64, 128):
        h = hadamard(n).double()
        assert ((h == 1) | (h == -1)).all() and torch.equal(h, h.T)
        assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    with pytest.raises(ValueError, match="power of two"):
        hadamard(96)


@pytest.mark.parametrize("head_dim", [16, 64, 128, 80, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rotated_scores_are_exact(head_dim, dtype):
    """R_q R_kᵀ = I with the matrices as stored in the model's dtype (their entries are ±2^-k: exact in fp16
    and bf16), so rotated q·k is q·k; every channel is spread evenly over its block."""
    rot = KVRotation.hadamard(head_dim, dtype, "cpu")
    assert rot.q.dtype == rot.k.dtype == dtype
    assert torch.equal(rot.q.double() @ rot.k.double().T, torch.eye(head_dim, dtype=torch.float64))
    block = head_dim & -head_dim
    spread = rot.k[0].double().abs()  # where a one-hot outlier in channel 0 goes: a flat row over its block
    assert (spread[:block] == spread[0]).all() and (spread[block:] == 0).all()


def test_centring_moves_each_querys_scores_by_one_constant():
    """(k − μ) shifts every score of a query by q·μ: softmax over the keys is unchanged, to fp64 precision."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 64, generator=g, dtype=torch.float64)
    k = torch.randn(9, 2, 64, generator=g, dtype=torch.float64)
    center = torch.randn(2, 64, generator=g, dtype=torch.float64) * 10
    qr, kr = KVRotation.hadamard(64, torch.float64, "cpu").rotate(q, k, center)
    def probs(q, k):
        return torch.einsum("nhd,lhd->hnl", q, k.repeat_interleave(2, dim=1)).softmax(-1)
    torch.testing.assert_close(probs(qr, kr), probs(q, k), rtol=1e-12, atol=1e-12)


def test_pools_rotate_int4_online_by_default_only():
    def rotation(bits, name=None, static=None):
        return PagedKV.allocate(2, 16, 2, 64, bits, torch.float32, "cpu", static=static, rotation=name).rotation

    static = tuple(torch.ones(2, dtype=torch.float16 if i % 2 == 0 else torch.uint8) for i in range(4))
    assert rotation(4) is not None and rotation(4, "auto") is not None
    assert rotation(8) is None and rotation(16) is None and rotation(4, static=static) is None
    assert rotation(4, "none") is None and rotation(8, "hadamard") is not None and rotation(16, "hadamard") is not None
    with pytest.raises(UserError, match="calibrated"):
        rotation(4, "hadamard", static)
