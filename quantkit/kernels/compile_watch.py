"""Which Triton kernels this process compiled (or loaded from the on-disk cache) on first sight, and when.

Triton calls `knobs.runtime.jit_post_compile_hook` each time a kernel specialization is built for the first
time in a process: compiled, or read from the compile cache. Each costs the step that meets it from
milliseconds (a cache hit) to seconds (a compilation). The engine compiles at start what its steps can meet;
`COMPILES.after_start` counts the specializations met later anyway, each logged once as a warning naming the
kernel, so a gap in the start-up warm-up shows in the log and in /metrics instead of as a slow request.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Optional

log = logging.getLogger(__name__)


class CompileWatch:
    def __init__(self) -> None:
        self.total = 0
        self.after_start = 0
        self.started = False
        self.names: Counter = Counter()
        self._previous: Optional[Any] = None
        self._installed = False
        self._lock = threading.Lock()

    def install(self) -> bool:
        """Chain our hook in front of any earlier one; False where this Triton has no such hook (or no Triton)."""
        with self._lock:
            if self._installed:
                return True
            try:
                from triton import knobs
            except ImportError:
                return False
            runtime = getattr(knobs, "runtime", None)
            if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
                return False
            self._previous = runtime.jit_post_compile_hook
            runtime.jit_post_compile_hook = self._hook
            self._installed = True
            return True

    def mark_started(self) -> None:
        """From now on a first sight counts as after start (the engine is ready)."""
        self.started = True

    def _hook(self, *args: Any, **kwargs: Any) -> Any:
        self.seen(str(getattr(kwargs.get("fn"), "name", None) or "a kernel"), kwargs.get("repr"))
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return None

    def seen(self, name: str, detail: Optional[str] = None) -> None:
        """Count one first sight of a specialization of kernel `name` (`detail`: Triton's description of it,
        its arguments' types and specializations, logged at debug level)."""
        with self._lock:
            self.total += 1
            self.names[name] += 1
            if not self.started:
                return
            self.after_start += 1
        log.warning("kernel %s met a new specialization after start (compiled now, in a request's time): "
                    "the start-up warm-up did not cover this step's shape", name)
        log.debug("the specialization: %s", detail)


COMPILES = CompileWatch()
