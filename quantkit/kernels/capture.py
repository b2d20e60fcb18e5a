"""Whether a call will run from a CUDA graph: the dispatch picks kernels by it (dispatch.choice_for).

Kept free of Triton, so the runtime can mark its warm-up before a capture without importing the kernels.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_AS_GRAPHED: ContextVar[bool] = ContextVar("quantkit_as_graphed", default=False)


@contextmanager
def graph_warmup() -> Iterator[None]:
    """Run the calls inside as if a CUDA graph were being captured: the warm-up before a capture then
    compiles and loads the kernels the capture will launch (the Gluon GEMM at M ≤ dispatch.EAGER_GEMV_MAX_M,
    which eager calls leave to the GEMV) and makes its split-K counts, outside the capture."""
    token = _AS_GRAPHED.set(True)
    try:
        yield
    finally:
        _AS_GRAPHED.reset(token)


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph, or the caller is warming up for one
    (`graph_warmup`); False off CUDA outside a warm-up."""
    return _AS_GRAPHED.get() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
