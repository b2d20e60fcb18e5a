"""Load any model that evaluation takes — an fp HF directory, a .gguf file or a quantkit checkpoint —
and describe it for comparison tables (method, bits, group size, KV bits, size)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from quantkit.config import KVQuantConfig
from quantkit.formats.kv_stats import LEGACY_FILE_NAME


@dataclass
class EvalModel:
    """A loaded model plus what a comparison table says about it."""

    model: Any
    tokenizer: Any
    path: str
    name: str
    method: str  # "fp", "rtn", "int8", "awq", …
    bits: int  # bits per weight (16 for fp)
    group_size: Optional[int]  # None for fp; -1 for one group per output channel
    kv: str  # "fp" or e.g. "KV8 online"
    size_bytes: int
    size_note: str = ""


def is_checkpoint(path: Path) -> bool:
    """True when `path` is a directory whose config.json says it is quantized (awq or compressed-tensors)."""
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        qc = json.loads(cfg.read_text()).get("quantization_config") or {}
    except json.JSONDecodeError:
        return False
    return qc.get("quant_method") in ("awq", "compressed-tensors")


def checkpoint_size(path: Path) -> int:
    """Bytes of the weight files in a model directory (not a root kv_stats.safetensors of an older layout)."""
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in path.glob(pattern)
               if f.name != LEGACY_FILE_NAME)


def _weight_fields(path: Path) -> tuple[str, int, Optional[int]]:
    from quantkit.runtime.loader import _layout_params, read_quant_config

    qc = read_quant_config(path)
    bits, group_size, _ = _layout_params(qc)
    method = qc["quant_method"]
    report = path / "quant_report.json"
    if report.is_file():
        method = json.loads(report.read_text()).get("method", method)
    return method, bits, group_size


def load_for_eval(path: str | Path, kv_bits: int = 16, kv_scales: str = "online", kv_stats: Optional[str] = None,
                  device: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> EvalModel:
    """Load `path` for evaluation, with a quantized KV cache attached when `kv_bits` is 8 or 4.

    Checkpoints load through `quantkit.load`; fp models likewise on CUDA in float16 when present, else
    on the CPU in float32, unless `device` / `dtype` say otherwise. See `set_kv_cache` for the KV settings.
    """
    KVQuantConfig(kv_bits, kv_scales)  # a bad --kv-bits fails here, before any loading
    p = Path(path)
    if p.is_dir() and is_checkpoint(p):
        from quantkit.runtime.loader import load

        model, tok = load(p, device=device, dtype=dtype)
        method, bits, group_size = _weight_fields(p)
        size, note = checkpoint_size(p), ""
    else:
        from quantkit.models.loading import load_fp_model

        # Same defaults as quantkit.load: the GPU in fp16 when there is one, else the CPU in fp32.
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        loaded = load_fp_model(p, dtype=dtype or (torch.float16 if dev.type == "cuda" else torch.float32))
        model, tok = loaded.model, loaded.tokenizer
        torch.nn.Module.to(model, dev)  # Module.to: transformers guards .to on models it flags quantized (GGUF)
        method, bits, group_size = "fp", 16, None
        if p.is_file():  # a .gguf is evaluated dequantized: its fp16 size is the one to compare with
            size = sum(t.numel() for t in model.parameters()) * 2  # parameters() counts tied weights once
            note = "fp16 size of the dequantized .gguf"
        else:
            size, note = checkpoint_size(p), ""
    em = EvalModel(model, tok, str(p), p.name, method, bits, group_size, "fp", size, note)
    return set_kv_cache(em, kv_bits, kv_scales, kv_stats)


def set_kv_cache(em: EvalModel, kv_bits: int, kv_scales: str = "online", kv_stats: Optional[str] = None) -> EvalModel:
    """Attach a quantized KV cache of `kv_bits` (8, 4; 16 removes it) to the loaded model, in place.

    Statistics for static scales come from `kv_stats` (a file or directory), else from the checkpoint.
    """
    from quantkit.runtime.kv_cache import attach_kv_cache

    p = Path(em.path)
    factory = attach_kv_cache(em.model, kv_stats if kv_stats is not None else (p if p.is_dir() else None),
                              kv_bits, kv_scales)
    em.kv = factory.settings.describe() if factory else "fp"
    return em
