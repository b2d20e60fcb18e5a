"""compressed-tensors pack-quantized: sequential packing with the 2^(b−1) offset, round trip exact."""

import pytest
import torch

from quantkit.formats.compressed_tensors import pack_compressed, quantization_config, unpack_compressed


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_round_trip(bits, symmetric):
    torch.manual_seed(bits)
    out_f, in_f, groups = 10, 36, 3  # not multiples of the values per word
    q = torch.randint(0, 2**bits, (out_f, in_f), dtype=torch.int32)
    z = torch.randint(0, 2**bits, (out_f, groups), dtype=torch.int32)
    if symmetric:
        z = torch.full_like(z, 2 ** (bits - 1))
    s = torch.rand(out_f, groups) + 0.1
    t = pack_compressed(q, z, s, bits, symmetric)
    assert t["weight_packed"].shape == (out_f, -(-in_f * bits // 32))
    assert ("weight_zero_point" in t) == (not symmetric)
    q2, z2, s2 = unpack_compressed(t, bits)
    assert torch.equal(q2, q) and torch.equal(z2, z)


def test_sequential_layout_signed_offset():
    # Signed value v is stored as v + 2^(b-1): quantkit's unsigned q is stored as is, first value lowest bits.
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.int32)
    t = pack_compressed(q, torch.full((1, 1), 8, dtype=torch.int32), torch.ones(1, 1), 4, True)
    word = int(t["weight_packed"][0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_config_entry():
    c = quantization_config(8, -1, True, ["lm_head"])
    w = c["config_groups"]["group_0"]["weights"]
    assert c["format"] == "pack-quantized" and c["quantization_status"] == "compressed"
    assert w["num_bits"] == 8 and w["strategy"] == "channel" and w["symmetric"] is True
    assert c["ignore"] == ["lm_head"]
