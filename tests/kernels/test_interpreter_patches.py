"""The two interpreter patches of conftest.py do what the GPU does: a bf16 `tl.dot` multiplies values
(not their uint16 bit patterns), and an fp32 → bf16 cast rounds to nearest even."""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def test_bf16_dot_and_cast_match_torch():
    import triton
    import triton.language as tl

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
        r = tl.arange(0, N)
        a = tl.load(a_ptr + r[:, None] * N + r[None, :])
        b = tl.load(b_ptr + r[:, None] * N + r[None, :])
        tl.store(out_ptr + r[:, None] * N + r[None, :], tl.dot(a, b))

    @triton.jit
    def cast_kernel(x_ptr, out_ptr, N: tl.constexpr):
        r = tl.arange(0, N)
        tl.store(out_ptr + r, tl.load(x_ptr + r).to(tl.bfloat16))

    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g).bfloat16()
    b = torch.randn(16, 16, generator=g).bfloat16()
    out = torch.empty(16, 16)
    dot_kernel[(1,)](a, b, out, N=16)
    assert torch.allclose(out, a.float() @ b.float(), rtol=1e-5, atol=1e-5)

    # Random fp32 values: about half of them round up, where truncation would go down.
    x = torch.randn(64, generator=g).float()
    y = torch.empty(64, dtype=torch.bfloat16)
    cast_kernel[(1,)](x, y, N=64)
    assert torch.equal(y, x.bfloat16())
