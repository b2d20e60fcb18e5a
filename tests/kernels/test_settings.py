"""Kernel settings are an object made once at the edge and handed down: the environment is read by
`KernelSettings.from_env` only (EngineConfig's default, quantkit.load), and the engine gives its settings
to every module that launches kernels and to its KV pool."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from quantkit.config import UserError
from quantkit.engine import Engine, EngineConfig
from quantkit.kernels.settings import AUTO, KernelSettings

PACKAGE = Path(__file__).resolve().parents[2] / "quantkit"


def test_from_env_reads_the_variables():
    assert KernelSettings.from_env({}) == AUTO == KernelSettings()
    got = KernelSettings.from_env({"QUANTKIT_KERNEL": " Reference ", "QUANTKIT_DECODE_KERNEL": "rows",
                                   "QUANTKIT_GLUON": "0", "QUANTKIT_PDL": "1", "QUANTKIT_DISPATCH_TABLE": "t.json"})
    assert got == KernelSettings(path="reference", decode="rows", gluon=False, pdl=True, table="t.json")
    with pytest.raises(UserError, match="QUANTKIT_KERNEL"):
        KernelSettings.from_env({"QUANTKIT_KERNEL": "cuda"})
    with pytest.raises(UserError, match="QUANTKIT_DECODE_KERNEL"):
        KernelSettings(decode="tensor")


def test_auto_runs_triton_only_where_the_hardware_takes_it(triton_interpreter):
    cpu = torch.device("cpu")
    assert not AUTO.triton(cpu)  # TRITON_INTERPRET alone does not switch
    assert KernelSettings(path="triton").triton(cpu) and not KernelSettings(path="reference").triton(cpu)


def test_nothing_in_the_package_reads_the_variables_but_from_env():
    readers = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef,
                      ast.FunctionDef)) and n.body and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (id(node) not in docstrings and isinstance(node, ast.Constant) and isinstance(node.value, str) and "QUANTKIT_" in node.value
                    and not any(other in node.value for other in ("QUANTKIT_DATA_DIR", "QUANTKIT_API_KEY",
                                                                  "QUANTKIT_CACHE_DIR"))):
                readers.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert readers and all(r.startswith("kernels/settings.py:") for r in readers), readers


def test_the_engine_hands_its_settings_down(tiny_models, monkeypatch):
    monkeypatch.setenv("QUANTKIT_KERNEL", "reference")
    config = EngineConfig(device="cpu", num_kv_tokens=256, kv_bits=8)
    monkeypatch.delenv("QUANTKIT_KERNEL")  # read once, when the config was made
    assert config.kernels == KernelSettings(path="reference")
    engine = Engine(str(tiny_models["llama"]), config)
    holders = [m for m in engine.model.modules() if hasattr(m, "kernels")]
    assert len(holders) > 3 and all(m.kernels is config.kernels for m in holders)
    assert all(cache.kernels is config.kernels for cache in engine.runner.kv_caches)
