"""AWQ gemm packing: the documented nibble order, written out by hand, gives the integers back."""

import torch

from quantkit.formats.awq_gemm import AWQ_PACK_ORDER, pack_awq_gemm, unpack_awq_gemm


def unpack_by_hand(word: int) -> list[int]:
    """Column j of a block of eight sits in nibble AWQ_PACK_ORDER.index(j) (unpack order [0,4,1,5,2,6,3,7])."""
    word &= 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    return [nibbles[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]


def test_pack_order_by_hand():
    q = torch.arange(8, dtype=torch.int32).reshape(1, 8).repeat(1, 1)  # out=8, in=1 after transpose
    packed = pack_awq_gemm(q.t().contiguous(), torch.zeros(8, 1, dtype=torch.int32), torch.ones(8, 1))
    word = int(packed["qweight"][0, 0])
    nibbles = [((word & 0xFFFFFFFF) >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == list(AWQ_PACK_ORDER)
    assert unpack_by_hand(word) == list(range(8))


def test_round_trip_exact_and_shapes():
    torch.manual_seed(0)
    out_f, in_f, gs = 24, 64, 32
    q = torch.randint(0, 16, (out_f, in_f), dtype=torch.int32)
    z = torch.randint(0, 16, (out_f, in_f // gs), dtype=torch.int32)
    s = torch.rand(out_f, in_f // gs) + 0.1
    t = pack_awq_gemm(q, z, s)
    assert t["qweight"].shape == (in_f, out_f // 8) and t["qweight"].dtype == torch.int32
    assert t["qzeros"].shape == (in_f // gs, out_f // 8)
    assert t["scales"].shape == (in_f // gs, out_f) and t["scales"].dtype == torch.float16
    q2, z2, s2 = unpack_awq_gemm(t["qweight"], t["qzeros"], t["scales"])
    assert torch.equal(q2, q) and torch.equal(z2, z)
    assert torch.equal(s2, s.half())
    # Every word, unpacked by the documented order, matches too.
    for r in range(3):
        for c in range(out_f // 8):
            assert unpack_by_hand(int(t["qweight"][r, c])) == q.t()[r, 8 * c : 8 * c + 8].tolist()
