"""KV codes against float64 math: error within half a step, packing inverse, static clipping."""

import pytest
import torch

from quantkit.runtime import kv_quant


def _rows(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 50, 64, generator=g) * 3
    x[..., 7] += 20  # an outlier channel, as keys have
    x[:, :, 0] = 0.0  # a constant row must not divide by zero
    return x


@pytest.mark.parametrize("bits", [8, 4])
def test_per_token_round_trip_within_half_step(bits):
    x = _rows()
    q, scale, zero = kv_quant.quantize_per_token(x, bits)
    assert q.dtype == torch.uint8 and scale.dtype == torch.float16 and zero.dtype == torch.uint8
    assert int(q.max()) <= kv_quant.QMAX[bits]
    back = kv_quant.decode(q, scale, zero, torch.float64)
    err = (back - x.double()).abs()
    # float64 reference of the bound: half the stored step, per row.
    assert torch.all(err <= scale.double() / 2 + 1e-9)
    # and the step is no coarser than the row's range needs (fp16 rounding up adds < 0.2 %)
    rng = x.double().amax(-1, keepdim=True).clamp(min=0) - x.double().amin(-1, keepdim=True).clamp(max=0)
    assert torch.all(scale.double() <= (rng / kv_quant.QMAX[bits]).clamp_min(2.0**-14) * 1.002)


def test_int4_pack_is_inverse_and_halves_bytes():
    q = torch.randint(0, 16, (2, 3, 5, 64), dtype=torch.uint8)
    p = kv_quant.pack_int4(q)
    assert p.shape[-1] == 32 and p.dtype == torch.uint8
    assert torch.equal(kv_quant.unpack_int4(p), q)
    assert int(p[0, 0, 0, 0]) == int(q[0, 0, 0, 0]) + 16 * int(q[0, 0, 0, 1])  # low nibble first


def test_static_codes_clip_outside_the_calibrated_range():
    scale, zero = kv_quant.range_params(torch.tensor([-1.0]), torch.tensor([1.0]), 8)
    x = torch.tensor([-1.0, 0.3, 1.0, 5.0])
    back = kv_quant.decode(kv_quant.encode(x, scale, zero, 8), scale, zero, torch.float32)
    assert torch.allclose(back[:3], x[:3], atol=float(scale) / 2 + 1e-7)
    assert back[3] <= 1.0 + float(scale)  # clipped, not wrapped around


def test_bad_bits_refused():
    with pytest.raises(ValueError):
        kv_quant.quantize_per_token(torch.randn(2, 8), 3)
