"""Launching a kept compiled kernel without Triton's front end (quantkit/kernels/launch.py)."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import launch


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, calls):
        self.calls = calls

    def run(self, *args):
        self.calls.append(("direct", args))


class _Fn:
    """A JIT function stand-in: `fn[grid](*args, **kwargs)` records the front-end launch."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.calls.append(("front end", grid, args, kwargs))
            return _Compiled(self.calls)
        return launch_


class _Driver:
    class active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 77)


def test_kept_kernel_calls_the_compiled_kernel_while_the_specialization_holds(monkeypatch):
    monkeypatch.setattr(launch, "driver", _Driver)
    fn = _Fn()
    kept = launch.KeptKernel(fn)
    a, b = torch.zeros(64, dtype=torch.float16), torch.zeros(64, dtype=torch.float16)
    kept((4, 2), (a, 4096, 7, 4, 2), num_warps=4)
    kept((8, 2), (b, 4096, 7, 4, 2), num_warps=4)  # another tensor, same dtype and alignment: direct
    assert [c[0] for c in fn.calls] == ["front end", "direct"]
    assert fn.calls[0][2:] == ((a, 4096, 7, 4, 2), dict(num_warps=4))
    assert fn.calls[1][1] == (8, 2, 1, 77, "function", "metadata", None, None, None, b, 4096, 7, 4, 2)
    kept((8, 2), (b, 8192, 7, 4, 2), num_warps=4)  # another size
    kept((8, 2), (b[1:], 4096, 7, 4, 2), num_warps=4)  # pointer not 16-byte aligned
    kept((8, 2), (b.float(), 4096, 7, 4, 2), num_warps=4)  # another dtype
    kept((8, 2), (b, 4096, 7, 8, 2), num_warps=4)  # another constexpr value
    kept((8, 2), (b, 4096, 7, 4, 2), num_warps=8)  # another option
    assert [c[0] for c in fn.calls[2:]] == ["front end"] * 5
    kept((8, 2), (b, 4096, 7, 4, 2), num_warps=8)
    kept((8, 2), (a, 8192, 7, 4, 2), num_warps=4)
    assert [c[0] for c in fn.calls[-2:]] == ["direct", "direct"]


def test_kept_for_says_whether_a_launch_would_load_nothing(monkeypatch):
    # what gluon_gemm asks during a CUDA-graph capture: launched before with this specialization?
    monkeypatch.setattr(launch, "driver", _Driver)
    kept = launch.KeptKernel(_Fn())
    a = torch.zeros(64, dtype=torch.float16)
    assert not kept.kept_for((a, 4096, 4), num_warps=4)
    kept((1,), (a, 4096, 4), num_warps=4)
    assert kept.kept_for((torch.ones(64, dtype=torch.float16), 4096, 4), num_warps=4)
    assert not kept.kept_for((a, 4096, 4), num_warps=8)  # another option
    assert not kept.kept_for((a, 2048, 4))  # another size
    kept.disabled = True  # a launcher that refused the direct call: nothing counts as kept
    assert not kept.kept_for((a, 4096, 4), num_warps=4)


def test_constexprs_that_look_alike_are_not_confused():
    """16 and 32 are both multiples of 16: as a block size they must still select different kernels."""
    assert launch.signature_key((torch.zeros(4), 16)) != launch.signature_key((torch.zeros(4), 32))
    assert launch.signature_key((torch.zeros(4), True)) != launch.signature_key((torch.zeros(4), False))


def test_tma_descriptors_are_keyed_by_what_the_front_end_specializes():
    """Gluon's host TensorDescriptor: dtype, block shape, layout and padding select the compiled kernel;
    its base tensor, shape and strides are launch arguments (a new x each call must not miss)."""
    gluon_hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    other = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)

    def desc(m, block, lay=layout, dtype=torch.float16):
        return gluon_hopper.TensorDescriptor.from_tensor(torch.zeros(m, 256, dtype=dtype), block, lay)

    key = launch.signature_key
    assert key((desc(16, [64, 128]), 4)) == key((desc(300, [64, 128]), 4))  # another x, another M
    assert key((desc(16, [64, 128]), 4)) != key((desc(16, [32, 128]), 4))
    assert key((desc(16, [64, 128]), 4)) != key((desc(16, [64, 128], other), 4))
    assert key((desc(16, [64, 128]), 4)) != key((desc(16, [64, 128], dtype=torch.bfloat16), 4))
    hash(key((desc(16, [64, 128]), 4)))  # usable as a dictionary key


def test_hooks_send_every_launch_through_the_front_end(monkeypatch):
    monkeypatch.setattr(launch, "driver", _Driver)
    fn = _Fn()
    kept = launch.KeptKernel(fn)
    t = torch.zeros(16)
    kept((1,), (t, 32))
    hook = launch.knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):
        def on_launch(metadata):
            return None

        hook.add(on_launch)
        try:
            assert launch.hooks_set()
            kept((1,), (t, 32))
        finally:
            hook.remove(on_launch)
    else:
        monkeypatch.setattr(launch.knobs.runtime, "launch_enter_hook", lambda metadata: None)
        assert launch.hooks_set()
        kept((1,), (t, 32))
    assert [c[0] for c in fn.calls] == ["front end", "front end"]
    assert not launch.hooks_set()
    kept((1,), (t, 32))
    assert fn.calls[-1][0] == "direct"


def test_interpreted_launches_keep_nothing():
    class Interpreted:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    kept = launch.KeptKernel(Interpreted())
    kept((1,), (torch.zeros(4), 3))
    assert kept.kept == {}


def test_a_launcher_that_refuses_the_direct_call_turns_it_off(monkeypatch):
    """Another Triton's launcher may take other arguments: its TypeError (raised before launching)
    sends this and every later call through the front end."""
    monkeypatch.setattr(launch, "driver", _Driver)
    fn = _Fn()

    class Refusing(_Compiled):
        def run(self, *args):
            self.calls.append(("refused", args))
            raise TypeError("function takes 14 positional arguments")

    launch_ = fn.__getitem__

    def getitem(grid):
        inner = launch_(grid)
        return lambda *a, **k: (inner(*a, **k), Refusing(fn.calls))[1]

    monkeypatch.setattr(_Fn, "__getitem__", lambda self, grid: getitem(grid))
    kept = launch.KeptKernel(fn)
    t = torch.zeros(16)
    for _ in range(3):
        kept((1,), (t, 32))
    assert [c[0] for c in fn.calls] == ["front end", "refused", "front end", "front end"]
    assert kept.disabled and kept.kept == {}
