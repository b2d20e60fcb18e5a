"""GPU tests: `pytest -m gpu tests/gpu` on a machine with CUDA (skipped without; CI has no GPU).

They run the compiled kernels, so the Triton interpreter must be off: tests/kernels/conftest.py turns
it on for the whole session when tests/kernels is collected too, hence "run tests/gpu on its own".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from quantkit_testing.gpu_checks import write_small_llama


@pytest.fixture(autouse=True)
def compiled_kernels(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 (tests/kernels/conftest.py sets it when collected): "
                    "run `pytest -m gpu tests/gpu` on its own")
    monkeypatch.delenv("QUANTKIT_KERNEL", raising=False)  # the default choice: Triton on CUDA


@pytest.fixture(scope="session")
def small_llama(tmp_path_factory) -> dict[str, Path]:
    """The fp16 source and three checkpoints quantkit wrote from it: W4 g128 AWQ (RTN), W8 per channel and
    FP8 W8A8 (e4m3 per channel, activations per token)."""
    import quantkit
    from quantkit.config import QuantizeConfig, WeightQuantConfig, build_config

    root = tmp_path_factory.mktemp("gpu_models")
    source = write_small_llama(root / "fp16")
    schemes = {
        "w4g128": QuantizeConfig(method="rtn", weight=WeightQuantConfig(4, 128)),
        "w8": QuantizeConfig(method="int8", weight=WeightQuantConfig(8, -1, True)),
        "fp8": build_config(method="fp8", fp8={"scheme": "dynamic", "weight_strategy": "channel"}),
    }
    out = {"fp16": source}
    for name, config in schemes.items():
        out[name] = quantkit.quantize(str(source), config, work_dir=root / name, progress=False).work_dir
    # The kernel tests take these for an AWQ gemm W4 g128 and a compressed-tensors W8 export.
    w4 = json.loads((out["w4g128"] / "config.json").read_text())["quantization_config"]
    assert (w4["quant_method"], w4["bits"], w4["group_size"]) == ("awq", 4, 128), w4
    w8 = json.loads((out["w8"] / "config.json").read_text())["quantization_config"]
    assert w8["quant_method"] == "compressed-tensors" and w8["config_groups"]["group_0"]["weights"]["num_bits"] == 8, w8
    return out
