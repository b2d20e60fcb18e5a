"""Launching a Triton kernel again without its front end.

Triton's JIT front end binds and specializes every argument on every call (alignment and divisibility
by 16 of pointers and integers, integers equal to 1, dtypes, constexpr values) before it finds the
compiled kernel: tens of microseconds of host time per launch, more than many of our kernels run
(bench/KERNELS_NOTES.md). After a first launch through the front end, the compiled kernel can
be called directly, as the front end itself does, for as long as nothing it specializes on changes.
Under TRITON_INTERPRET there is no compiled kernel; every call then takes the front end.
"""

from __future__ import annotations

import os

import torch
from triton import knobs
from triton.runtime import driver

from quantkit.kernels.compile_watch import COMPILES


def interpreted() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (TRITON_INTERPRET set)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def hooks_set() -> bool:
    """Whether Triton launch hooks are set (a profiler's): then every launch takes the front end."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool((enter is not None and getattr(enter, "calls", True))
                or (leave is not None and getattr(leave, "calls", True)))


def compiled_form(result: object) -> object | None:
    """What a front-end launch returned, if it is a compiled kernel that can be called directly."""
    return result if all(hasattr(result, a) for a in ("run", "function", "packed_metadata")) else None


def run_compiled(ck, grid: tuple[int, ...], args: tuple) -> bool:
    """Launch compiled kernel `ck` on the current stream with every argument of the kernel, constexprs
    included, in its parameter order (what the front end hands it). False, without launching, if the
    launcher rejects the call (another Triton's calling convention): the caller then uses the front end."""
    device = driver.active.get_current_device()
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    try:
        ck.run(grid[0], g1, g2, driver.active.get_current_stream(device), ck.function, ck.packed_metadata, None,
               None, None, *args)
    except TypeError:  # raised while parsing the arguments, before any launch
        return False
    return True


def _arg_key(a: object) -> object:
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if hasattr(a, "base") and hasattr(a, "block_shape") and hasattr(a, "layout"):  # a host TMA descriptor
        return "desc", a.base.dtype, tuple(a.block_shape), a.layout, getattr(a, "padding", None)
    return a


def signature_key(args: tuple) -> tuple:
    """A key that changes whenever the front end could specialize these arguments differently: tensors
    by dtype and 16-byte alignment, host TMA descriptors (Gluon's TensorDescriptor) by dtype, block shape,
    shared-memory layout and padding (their base is always 16-byte aligned; shape and strides are
    launch arguments), everything else (integers, constexprs, strings) by value. Integers go in whole
    rather than by the front end's classes (divisible by 16, equal to 1, 32 or 64 bits), so a constexpr
    can never be mistaken for an argument; a new size costs one more front-end launch."""
    return tuple(_arg_key(a) for a in args)


class KeptKernel:
    """A Triton kernel whose compiled forms are kept, keyed by `signature_key` of its arguments and the
    launch options; a launch with a kept key calls the compiled kernel directly. `args` are all the
    kernel's parameters, constexprs included, in parameter order."""

    MAX_KEPT = 4096  # distinct keys kept (each holds a reference to a compiled kernel, not a copy)

    def __init__(self, fn) -> None:
        self.fn = fn
        self.kept: dict = {}
        self.disabled = False  # set when the launcher refused a direct call
        self.compiled: set[int] = set()  # ids of the compiled kernels the front end has returned (Triton keeps them)
        self.name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "?")

    def kept_for(self, args: tuple, **options) -> bool:
        """Whether a launch with these arguments and options would find a kept compiled kernel: it has
        been launched before, so its module is loaded and launching it loads nothing (which a CUDA graph
        capture forbids)."""
        return not self.disabled and (signature_key(args), tuple(sorted(options.items()))) in self.kept

    def __call__(self, grid: tuple[int, ...], args: tuple, **options) -> None:
        key = (signature_key(args), tuple(sorted(options.items())))
        ck = self.kept.get(key)
        if ck is not None and not hooks_set():
            if run_compiled(ck, grid, args):
                return
            self.disabled, self.kept = True, {}
        ck = compiled_form(self.fn[grid](*args, **options))
        if ck is not None and id(ck) not in self.compiled:  # a specialization new to this process
            self.compiled.add(id(ck))
            COMPILES.seen(self.name)
        if ck is not None and not self.disabled:
            if len(self.kept) >= self.MAX_KEPT:
                self.kept.clear()
            self.kept[key] = ck
