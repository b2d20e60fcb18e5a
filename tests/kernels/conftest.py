"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

TRITON_INTERPRET must be set before a kernel module is imported (the @triton.jit decorator reads it),
so it is set here, at collection time. Three interpreter bugs are patched for the tests (Triton 3.x):
a bf16 `tl.dot` multiplies the raw uint16 bit patterns, fp32 → bf16 casts truncate instead of
rounding to nearest even as the GPU does, and fp32 → e4m3 casts round half up and drop the carry
when rounding up crosses a power of two (124.3 → 64, not 128); the GPU's conversions are exact. The `mma_asm` fixture also lets the interpreter run the
tensor-core GEMV's inline PTX (which it rejects) through tests/support/quantkit_testing/ptx_interp.py.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


def _patch_interpreter() -> None:
    import triton.language as tl
    from triton.runtime import interpreter as interp

    if getattr(interp, "_quantkit_patched", False):
        return
    dot, convert = interp.InterpreterBuilder.create_dot, interp._convert_float

    def as_f32(h):
        return (h.data.astype(np.uint32) << 16).view(np.float32) if h.dtype.scalar == tl.bfloat16 else h.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            return interp.TensorHandle(np.matmul(as_f32(a), as_f32(b), dtype=d.data.dtype) + d.data, d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def convert_float(values, in_dtype, out_dtype, rounding_mode):
        if in_dtype == tl.float32 and out_dtype == tl.bfloat16:
            bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
            return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).reshape(values.shape)
        if in_dtype == tl.float32 and out_dtype == tl.float8e4nv:  # torch's cast rounds to nearest even
            f32 = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
            return f32.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(values.shape)
        return convert(values, in_dtype, out_dtype, rounding_mode)

    interp.InterpreterBuilder.create_dot = create_dot
    interp._convert_float = convert_float
    interp._quantkit_patched = True


@pytest.fixture(scope="session")
def triton_interpreter():
    """Skip kernel tests where Triton is not installed; patch its interpreter where it is."""
    pytest.importorskip("triton")
    from quantkit.kernels.triton_gemv import gemv_kernel

    # The kernels must have been decorated after TRITON_INTERPRET was set, or the tests would try a GPU.
    assert type(gemv_kernel).__name__ == "InterpretedFunction", "a kernel module was imported before conftest"
    _patch_interpreter()


class _AsmCall:
    def __init__(self, results):
        self.results = results

    def get_result(self, i):
        return self.results[i]


@pytest.fixture
def mma_asm(triton_interpreter):
    """Run `tl.inline_asm_elementwise` under the interpreter with the PTX interpreter, reading memory
    from the tensors passed to the returned `use_memory(*tensors)` (x and the packed words)."""
    from triton.runtime import interpreter as interp

    from quantkit_testing.ptx_interp import TensorMemory, run_inline_asm

    state = {}

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        assert pack == 1
        outs = run_inline_asm(asm, constraints, [v.data for v in values], state["memory"])
        return _AsmCall([interp.TensorHandle(o.astype(np.float32 if t.element_ty == tl.float32 else np.int32),
                                             t.element_ty) for o, t in zip(outs, types)])

    import builtins

    import triton.language as tl
    from triton.language import core

    def inline_asm_elementwise(*args, **kwargs):
        # Several outputs come back as a tl.tuple, which the interpreter cannot append to a Python
        # tuple (`ops + acc` in the kernel's loop); the compiler can. Hand them back as a Python tuple.
        kwargs["_semantic"] = interp.interpreter_semantic
        res = core.inline_asm_elementwise(*args, **kwargs)
        return builtins.tuple(res.values) if isinstance(res, core.tuple) else res

    original = interp.InterpreterBuilder.create_inline_asm, tl.inline_asm_elementwise
    interp.InterpreterBuilder.create_inline_asm = create_inline_asm
    tl.inline_asm_elementwise = inline_asm_elementwise
    yield lambda *tensors: state.update(memory=TensorMemory(*tensors))
    interp.InterpreterBuilder.create_inline_asm, tl.inline_asm_elementwise = original
