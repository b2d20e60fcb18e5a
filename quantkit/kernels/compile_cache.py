"""Where compiled kernels are kept between runs: `--cache-dir`, by default $QUANTKIT_CACHE_DIR, else
$XDG_CACHE_HOME/quantkit, else ~/.cache/quantkit.

Triton writes each kernel it compiles (and TorchInductor its graphs) to an on-disk cache and reads it back in
the next process, so a restarted or a second server loads its kernels instead of compiling them (a 7B server's
start: minutes cold, seconds warm). `use_cache_dir` points both caches under one folder the user chose:
<dir>/triton and <dir>/inductor. A TRITON_CACHE_DIR the user set already is kept unless --cache-dir is given.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from quantkit.config import UserError

ENV = "QUANTKIT_CACHE_DIR"


def default_cache_dir() -> Path:
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quantkit"


def use_cache_dir(path: Optional[str | Path] = None) -> Path:
    """Make the cache folder (`path`, else `default_cache_dir()`) and send Triton's and TorchInductor's caches
    there, before anything compiles. Returns the folder; an unwritable one is a UserError."""
    root = Path(path).expanduser() if path else default_cache_dir()
    try:
        for sub in ("triton", "inductor"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        probe = root / "triton" / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"--cache-dir {root}: cannot write there ({exc.strerror or exc}): pass a writable "
                        f"folder, or set {ENV}") from None
    if path or not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    if path or not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    return root
