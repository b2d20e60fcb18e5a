"""Exports are byte-for-byte what they were: every written safetensors file and config file of a tiny random
model, quantized in each format and layout, hashes to the digest recorded from a known-good build.

Tokenizer files and quant_report.json (timings, versions) are left out; in the config files the
`transformers_version` value is blanked, so a newer transformers alone does not fail the test.
RTN only: its codes come from element-wise arithmetic, the same on every CPU (AWQ's search sums
products, whose order a CPU may change). Run this file as a script to print the digests of the code
at hand."""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import pytest

# (architecture, method, bits, group size, symmetric, format, KV statistics) → {file: sha256}
CASES = {
    "awq-g32": ("llama", "rtn", 4, 32, False, "awq", True),
    "awq-channel": ("qwen2", "rtn", 4, -1, False, "awq", False),
    "ct4-sym-g32": ("llama", "rtn", 4, 32, True, "compressed-tensors", False),
    "ct4-asym-g32-kv": ("llama", "rtn", 4, 32, False, "compressed-tensors", True),
    "ct4-asym-g16-qwen2": ("qwen2", "rtn", 4, 16, False, "compressed-tensors", False),
    "ct8-sym-g32": ("llama", "rtn", 8, 32, True, "compressed-tensors", False),
    "ct8-asym-channel": ("llama", "rtn", 8, -1, False, "compressed-tensors", False),
    "int8-sym": ("llama", "int8", 8, -1, True, "compressed-tensors", False),
    "int8-asym": ("qwen2", "int8", 8, -1, False, "compressed-tensors", False),
}

DIGESTS: dict[str, dict[str, str]] = {
    'awq-channel': {
        'config.json': '979e12fa57caad09d9eb0b76ef130adf18bd20b8e60159177320cb5880cfba1d',
        'generation_config.json': '95413a482847cf4c8f8b822ec2d17084029ff9a71d7603bfc159f14e6516d671',
        'model.safetensors': '8ad01d5c1906219e8cb851e51e539206014f1722dce5881201c1f0654943b1e5',
    },
    'awq-g32': {
        'config.json': '6f82298a6c201dc9719b7b2d1a464a0dedc53eec7c5c11589f3c54be07cf73e4',
        'generation_config.json': '95413a482847cf4c8f8b822ec2d17084029ff9a71d7603bfc159f14e6516d671',
        'model.safetensors': '03101ae20344fcfcc0cf5d21914b5537dc74c44cd5f1fd8fded3af819ed9f739',
        'quantkit/kv_stats.safetensors': '15c2ecf8b6c9c0ac4a29ed89b913f3f2a272e62e0cf61c7e715ef87852ea848a',
    },
    'ct4-asym-g16-qwen2': {
        'config.json': '32dd2c0572c3d549a3b58252c3a2cb06bf9d8c614b61efed443a93318717e5a3',
        'generation_config.json': '95413a482847cf4c8f8b822ec2d17084029ff9a71d7603bfc159f14e6516d671',
        'model.safetensors': '652680c07e02825ed6a1c2fa5e267a21acfa1db8e33ebf2cf50c1b154f07f894',
    },
    'ct4-asym-g32-kv': {
        'config.json': '6cf4b7faa55269030c561005774a9e07b7654fdbde65b81c48127a5a36a8f36f',
        'generation_config.json': '95413a482847cf4c8f8b822ec2d17084029ff9a71d7603bfc159f14e6516d671',
        'model.safetensors': 'e954eca524c49abffed7b76ca98de05ff2603f796d551e9e431468fdb8dc7776',
        'quantkit/kv_stats.safetensors': '15c2ecf8b6c9c0ac4a29ed89b913f3f2a272e62e0cf61c7e715ef87852ea848a',
    },
    'ct4-sym-g32': {
        'config.json': '055186e61ba116c04b5cc92de0802f0c6a8a7885f1cdbcb0689ec391783f8cd9',
        'generation_config.json': '95413a482847cf4c8f8b822ec2d17084029ff9a71d7603bfc159f14e6516d671',
        'model.safetensors': 'aea06c0eef368e43a1f80ac7bd75be003cd1673009adf1e4d76e3d69527a48fb',
    },
    'ct8-asym-channel': {
        'config.json': 'd13f2631e02d57b0398431ca5741a07dcacf188459026709e067e3a29d75224c',
        'generation_config.json': '95413a482847cf4c8f8b822ec2d17084029ff9a71d7603bfc159f14e6516d671',
        'model.safetensors': '60efb7fde6ec3d1b3018e65fca6a45fda1507416e934f86411d6fd72a5b7623e',
    },
    'ct8-sym-g32': {
        'config.json': '43c6b9232ca98e2ee7977e1cd8652c02406147d9294170c2cff0ed12187316e4',
        'generation_config.json': '95413a482847cf4c8f8b822ec2d17084029ff9a71d7603bfc159f14e6516d671',
        'model.safetensors': 'b939275aa4dbc1c15cc9d47329bc92a5cef21989443944f525b9ad4e35b4d60f',
    },
    'int8-asym': {
        'config.json': '3d38a97d6a49b860f2e05801dba66d513d6a9db6233af7e822b51bcd798048f9',
        'generation_config.json': '95413a482847cf4c8f8b822ec2d17084029ff9a71d7603bfc159f14e6516d671',
        'model.safetensors': '5b6b0226920395523884751b29206630019b04490cb0da056cf7c17949cceae7',
    },
    'int8-sym': {
        'config.json': '23f35dda7d748d5aa26ddb1098e7bc405f890e2a3c2e12a4af509714f695427b',
        'generation_config.json': '95413a482847cf4c8f8b822ec2d17084029ff9a71d7603bfc159f14e6516d671',
        'model.safetensors': 'c8aed18022730df38b8456be8ddeff40d377814fb00dabc97352541e9e30dee3',
    },
}

_VERSION = re.compile(rb'"transformers_version": "[^"]*"')


def digests(directory: Path) -> dict[str, str]:
    """sha256 of each safetensors and JSON config file under `directory`, keyed by relative path."""
    out = {}
    for f in sorted(directory.rglob("*")):
        if f.suffix == ".safetensors" or f.name in ("config.json", "generation_config.json"):
            data = _VERSION.sub(b'"transformers_version": ""', f.read_bytes())
            out[str(f.relative_to(directory))] = hashlib.sha256(data).hexdigest()
    return out


def export(case: str, models: dict[str, Path], text_file: Path, out: Path) -> Path:
    import quantkit
    from quantkit.config import QuantizeConfig, WeightQuantConfig

    arch, method, bits, group, symmetric, fmt, kv = CASES[case]
    cfg = QuantizeConfig(method=method, weight=WeightQuantConfig(bits, group, symmetric), format=fmt)
    return quantkit.quantize(str(models[arch]), cfg, work_dir=out, progress=False,
                             kv_calib=str(text_file) if kv else None).work_dir


@pytest.fixture(autouse=True)
def one_thread():
    """The KV statistics come from a forward pass: one thread keeps its summation order fixed."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_bytes_are_unchanged(case, tiny_models, text_file, tmp_path):
    assert digests(export(case, tiny_models, text_file, tmp_path / case)) == DIGESTS[case]


if __name__ == "__main__":  # print DIGESTS for the code on sys.path
    import tempfile

    import torch
    from quantkit_testing.tiny import make_text, write_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = {arch: write_tiny_model(arch, root / arch) for arch in ("llama", "qwen2")}
        text = root / "calib.txt"
        text.write_text(make_text(4000, 2))
        print("DIGESTS = {")
        for name in sorted(CASES):
            print(f"    {name!r}: {digests(export(name, models, text, root / name))!r},")
        print("}")
    sys.exit(0)
