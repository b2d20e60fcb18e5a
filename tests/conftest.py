"""Session fixtures: tiny models on disk and a calibration text (helpers live in tiny.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantkit.models.registry import spec_for_config
from quantkit_testing.tiny import (  # noqa: F401  (re-exported: tests may import helpers from conftest too)
    llama_to_internlm2,
    make_text,
    make_tiny_model,
    make_tokenizer,
    tiny_config,
    write_tiny_model,
)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (tests/gpu; skipped without one, never run in CI)")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Directories of tiny random llama, mistral, qwen2, qwen3 and InternLM2-layout models."""
    root = tmp_path_factory.mktemp("models")
    dirs = {arch: write_tiny_model(arch, root / arch) for arch in ("llama", "mistral", "qwen2", "qwen3")}
    dirs["internlm2"] = llama_to_internlm2(dirs["llama"], root / "internlm2")
    # Each directory must reach its own registry entry (not, say, Mistral served by Llama's).
    for arch, d in dirs.items():
        assert spec_for_config(json.loads((d / "config.json").read_text())).name == arch, arch
    return dirs


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("text") / "calib.txt"
    p.write_text(make_text(4000, 2))
    return p


# Folders whose tests run tiny models: one thread is far faster than several on shared cores.
_ONE_THREAD = {"quantize", "engine", "runtime", "models"}


@pytest.fixture(autouse=True)
def one_thread(request):
    if request.path.parent.name not in _ONE_THREAD:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
