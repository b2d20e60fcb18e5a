"""`load()`: a packed checkpoint → a transformers model whose linears are QuantLinear (or Fp8Linear) modules."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch

from quantkit.config import check_device
from quantkit.formats.checkpoint import CheckpointError, read_safetensors
from quantkit.formats.compressed_tensors import KV_SCALE_NAMES
from quantkit.formats.registry import QUANT_METHODS, UnsupportedFormat, format_of
from quantkit.kernels.settings import KernelSettings
from quantkit.nn.fp8_linear import Fp8Linear
from quantkit.nn.quant_linear import QuantLinear

log = logging.getLogger(__name__)


def read_quant_config(path: Path) -> dict[str, Any]:
    """config.json's quantization_config, or a CheckpointError saying why the path is not a checkpoint
    quantkit can load (no config, invalid JSON, not quantized, an AWQ version or format it cannot run)."""
    cfg_file = path / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} is not a quantkit checkpoint: it has no config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f" at line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise CheckpointError(f"{cfg_file} is not valid JSON ({getattr(exc, 'msg', exc)}{where}): "
                              "repair it or re-create the checkpoint") from None
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if not qc or qc.get("quant_method") not in QUANT_METHODS:
        raise CheckpointError(f"{path} is not a quantized checkpoint (no {' or '.join(QUANT_METHODS)} "
                              "quantization_config); quantize it first with `quantkit rtn|int8|awq|fp8`")
    try:
        format_of(qc)
    except UnsupportedFormat as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return qc


def model_config(path: Path):
    """The checkpoint's transformers config without its quantization_config, or a one-line CheckpointError
    (e.g. an unknown model_type) instead of transformers' traceback."""
    from quantkit.models.loading import ModelLoadError, transformers_config

    try:
        return transformers_config(path)
    except ModelLoadError as exc:
        raise CheckpointError(str(exc)) from None


def _replace_linears(model: torch.nn.Module, sd: dict[str, torch.Tensor], qc: dict[str, Any], dtype) -> list[str]:
    """Put a QuantLinear, built by the engine's loader from its tensors (taken out of `sd`), in place of each
    packed linear; returns their names."""
    from quantkit.engine.weights import quant_linear

    fmt = format_of(qc)
    layout = fmt.read_layout(qc)
    names = [key.rpartition(".")[0] for key in sd if key.rpartition(".")[2] == fmt.marker]
    for name in names:
        part = {t: sd.pop(f"{name}.{t}") for t in (*fmt.tensor_names, "bias") if f"{name}.{t}" in sd}
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, quant_linear([part], fmt, layout, dtype))
    return names


def _transformers_names(config: Any):
    """The registry's renaming of a family's checkpoint names to its transformers class's module names
    (LLaVA's llava-hf layout), or None when the names are the module names."""
    from quantkit.models.registry import UnsupportedArchitecture, spec_for_config

    try:
        return spec_for_config(config).transformers_state_dict
    except UnsupportedArchitecture:
        return None


def load(
    path: str | Path,
    device: Optional[str | torch.device] = None,
    dtype: Optional[torch.dtype] = None,
    cache_dequantized: Optional[bool] = None,
    kernels: Optional[KernelSettings] = None,
) -> tuple[torch.nn.Module, Any]:
    """Load a quantkit checkpoint; returns (model, tokenizer).

    `device` defaults to CUDA when present, else the CPU; `dtype` (of activations and unquantized
    tensors) to float16 on CUDA and float32 on the CPU. Its KV cache is transformers' own (unquantized):
    quantized KV caches are the engine's (`quantkit.pipeline`, `EngineConfig(kv_bits=...)`).
    `cache_dequantized` (default: on the CPU) keeps each layer's dequantized weight after its first
    use in the reference path, trading the memory saving for speed. `kernels` (default: what the
    QUANTKIT_* variables ask for, kernels/settings.py) say which kernels its quantized linears run.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    qc = read_quant_config(path)
    check_device(None if device is None else str(device))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    config = model_config(path)
    sd = read_safetensors(path)
    # vLLM's fp8 KV scales (compressed-tensors kv_cache_scheme); this runtime reads quantkit/kv_stats.safetensors.
    sd = {k: v for k, v in sd.items() if k.rpartition(".")[2] not in KV_SCALE_NAMES}
    to_transformers = _transformers_names(config)
    with init_empty_weights(include_buffers=False):
        if to_transformers is None:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:  # a multimodal export in its source layout (LLaVA): transformers' own class, renamed tensors
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
            sd = to_transformers(sd, set(model.state_dict()))
    quantized = _replace_linears(model, sd, qc, dtype)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    filled = tuple(f"{name}." for name in quantized)
    missing = [m for m in missing if not (tied and m == "lm_head.weight") and not m.startswith(filled)]
    if missing or unexpected:
        raise CheckpointError(f"{path}: tensors do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if tied:
        model.tie_weights()
    model.to(device).eval()
    cache = cache_dequantized if cache_dequantized is not None else device.type == "cpu"
    kernels = kernels or KernelSettings.from_env()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.cache_dequantized, module.kernels = cache, kernels
        elif isinstance(module, Fp8Linear):
            module.cache_dequantized = cache
    if (path / "generation_config.json").is_file():
        # The export's EOS list (e.g. a chat model's end-of-turn token) and sampling defaults;
        # from_config alone would leave only the config's single eos_token_id.
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(path))
    log.info("loaded %s: %d quantized linears on %s", path, len(quantized), device)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model, tokenizer
