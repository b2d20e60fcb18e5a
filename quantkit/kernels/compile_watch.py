"""Which Triton kernels this process compiled (or loaded from the on-disk cache) on first sight, and when.

Every Triton kernel of ours launches through `launch.KeptKernel`, which sees the compiled kernel each
front-end launch returns: one it has not seen before is a specialization built in this process for the
first time (compiled, or read from the compile cache), which costs the step that meets it from
milliseconds (a cache hit) to seconds (a compilation). The engine compiles at start what its steps can
meet; `COMPILES.after_start` counts the specializations met later anyway, each logged as a warning naming
the kernel, so a gap in the start-up warm-up shows in the log and in /metrics instead of as a slow request.
(Triton's own jit_post_compile_hook is not used: with a hook set, Triton 3.6 serializes each
specialization to JSON, which fails on Gluon kernels' layouts.)
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

log = logging.getLogger(__name__)


class CompileWatch:
    def __init__(self) -> None:
        self.total = 0
        self.after_start = 0
        self.started = False
        self.names: Counter = Counter()
        self._lock = threading.Lock()

    def mark_started(self) -> None:
        """From now on a first sight counts as after start (the engine is ready)."""
        self.started = True

    def seen(self, name: str) -> None:
        """Count one first sight of a specialization of kernel `name`."""
        with self._lock:
            self.total += 1
            self.names[name] += 1
            if not self.started:
                return
            self.after_start += 1
        log.warning("kernel %s met a new specialization after start (compiled now, in a request's time): "
                    "the start-up warm-up did not cover this step's shape", name)


COMPILES = CompileWatch()
