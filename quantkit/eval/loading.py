"""Load any model that evaluation takes — an fp HF directory, a .gguf file or a quantkit checkpoint — as
the engine's decoder (what `chat` and `serve` run) or, for `eval ppl --reference`, as transformers' own
model; and describe it for comparison tables (method, bits, group size, size)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from quantkit.formats.kv_stats import LEGACY_FILE_NAME
from quantkit.formats.registry import QUANT_METHODS, format_of


@dataclass
class EvalModel:
    """A loaded model plus what a comparison table says about it."""

    model: Any  # a DecoderModel (the engine), or a transformers model (`reference`)
    tokenizer: Any
    path: str
    name: str
    method: str  # "fp", "rtn", "int8", "awq", …
    bits: int  # bits per weight (16 for fp)
    group_size: Optional[int]  # None for fp; -1 for one scale per output channel, 0 for one per tensor
    size_bytes: int
    size_note: str = ""
    reference: bool = False  # transformers' modeling code instead of the engine's


def is_checkpoint(path: Path) -> bool:
    """True when `path` is a directory whose config.json says it is quantized (awq or compressed-tensors)."""
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        qc = json.loads(cfg.read_text()).get("quantization_config") or {}
    except json.JSONDecodeError:
        return False
    return qc.get("quant_method") in QUANT_METHODS


def checkpoint_size(path: Path) -> int:
    """Bytes of the weight files in a model directory (not a root kv_stats.safetensors of an older layout)."""
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in path.glob(pattern)
               if f.name != LEGACY_FILE_NAME)


def _weight_fields(path: Path) -> tuple[str, int, Optional[int]]:
    from quantkit.runtime.loader import read_quant_config

    qc = read_quant_config(path)
    layout = format_of(qc).read_layout(qc)
    method = qc["quant_method"]
    report = path / "quant_report.json"
    if report.is_file():
        method = json.loads(report.read_text()).get("method", method)
    return method, layout.bits, layout.scale_group


def _describe(p: Path, model: Any, tokenizer: Any, reference: bool) -> EvalModel:
    if is_checkpoint(p):
        method, bits, group_size = _weight_fields(p)
        size, note = checkpoint_size(p), ""
    elif p.is_file():  # a .gguf is evaluated dequantized: its fp16 size is the one to compare with
        method, bits, group_size = "fp", 16, None
        size = sum(t.numel() for t in model.parameters()) * 2  # parameters() counts tied weights once
        note = "fp16 size of the dequantized .gguf"
    else:
        method, bits, group_size = "fp", 16, None
        size, note = checkpoint_size(p), ""
    return EvalModel(model, tokenizer, str(p), p.name, method, bits, group_size, size, note, reference)


def _device(device: Optional[str]) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def load_engine_model(path: str | Path, device: Optional[str] = None, dtype: Any = None) -> EvalModel:
    """`path` as the engine's decoder (engine.model.load_decoder, `dtype` resolved as the engine does: None is
    auto). A .gguf is dequantized into a temporary HF directory first (fp16 on CUDA, fp32 on the CPU)."""
    from quantkit.engine.model import load_decoder
    from quantkit.models.loading import ModelLoadError, load_fp_model

    p, dev = Path(path), _device(device)
    if not p.exists():
        raise ModelLoadError(f"{p} does not exist: pass a model directory, a .gguf file or a quantkit checkpoint")
    if p.is_dir():
        model, tokenizer, _ = load_decoder(p, dev, dtype)
        return _describe(p, model, tokenizer, reference=False)
    loaded = load_fp_model(p, dtype=torch.float16 if dev.type == "cuda" else torch.float32)
    with tempfile.TemporaryDirectory(prefix="quantkit-gguf-") as tmp:
        loaded.model.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        del loaded
        model, tokenizer, _ = load_decoder(tmp, dev, dtype)
    return _describe(p, model, tokenizer, reference=False)


def load_reference_model(path: str | Path, device: Optional[str] = None,
                         dtype: Optional[torch.dtype] = None) -> EvalModel:
    """`path` as transformers' own model (`eval ppl --reference`): checkpoints through `quantkit.load`,
    fp models through `load_fp_model`; on CUDA in float16 when present, else on the CPU in float32."""
    p = Path(path)
    if p.is_dir() and is_checkpoint(p):
        from quantkit.runtime.loader import load

        model, tokenizer = load(p, device=device, dtype=dtype)
    else:
        from quantkit.models.loading import load_fp_model

        dev = _device(device)
        loaded = load_fp_model(p, dtype=dtype or (torch.float16 if dev.type == "cuda" else torch.float32))
        model, tokenizer = loaded.model, loaded.tokenizer
        torch.nn.Module.to(model, dev)  # Module.to: transformers guards .to on models it flags quantized (GGUF)
    return _describe(p, model, tokenizer, reference=True)
