"""Session fixtures: tiny models on disk, a calibration text, the CLI → EngineConfig stubs (helpers: quantkit_testing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TEST_DEPENDENCIES = ("torch", "transformers", "typer", "safetensors", "tqdm", "triton", "aiohttp", "playwright")
# `pytest -m gpu tests/gpu` runs the engine and its kernels only: a GPU machine needs no browser or server stack.
GPU_TEST_DEPENDENCIES = ("torch", "transformers", "safetensors", "tqdm", "triton")


@pytest.fixture
def engine_config_of(monkeypatch, tmp_path):
    """`engine_config_of(command)` → (the EngineConfigs the library call behind `quantkit COMMAND` receives,
    the command's argv on a dummy model): generate, chat and serve, with that call stubbed out."""
    import quantkit.engine.chat
    import quantkit.engine.pipeline
    import quantkit.server.launch

    seen: list = []

    def stub(command: str) -> tuple[list, list[str]]:
        if command == "generate":
            monkeypatch.setattr(quantkit.engine.pipeline, "pipeline",
                                lambda path, config: seen.append(config) or (lambda *a, **k: []))
            return seen, ["generate", str(tmp_path), "hi"]
        if command == "chat":
            monkeypatch.setattr(quantkit.engine.chat, "chat", lambda model, config, *a: seen.append(config))
            return seen, ["chat", str(tmp_path)]
        assert command == "serve", command
        monkeypatch.setattr(quantkit.server.launch, "serve", lambda config: seen.append(config.engine))
        return seen, ["serve", str(tmp_path)]

    return stub


def pytest_configure(config):
    # A Python without the test dependencies gets one line saying how to get them, not an error per file.
    needed = GPU_TEST_DEPENDENCIES if config.option.markexpr == "gpu" else TEST_DEPENDENCIES
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        pytest.exit(f"this Python lacks {', '.join(missing)}: run `bash .ci/run` (a fresh environment with "
                    "everything), or install torch for your platform and then `pip install -e '.[dev]'`", returncode=4)
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (tests/gpu; skipped without one, never run in CI)")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Directories of tiny random llama, mistral, qwen2, qwen3 and InternLM2-layout models."""
    from quantkit.models.registry import spec_for_config
    from quantkit_testing.tiny import llama_to_internlm2, write_tiny_model

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
    from quantkit_testing.tiny import make_text

    p.write_text(make_text(4000, 2))
    return p


# Folders whose tests run tiny models: one thread is far faster than several on shared cores.
_ONE_THREAD = {"quantize", "engine", "runtime", "models"}


@pytest.fixture(autouse=True)
def one_thread(request):
    if request.path.parent.name not in _ONE_THREAD:
        yield
        return
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
