"""Load a full-precision causal LM from a Hugging Face directory or a .gguf file, on the CPU.

InternLM2 checkpoints are converted to the Llama layout here (no remote code is run).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from quantkit.config import UserError
from quantkit.models import internlm2, tokenizer_convert
from quantkit.models.registry import ArchSpec, spec_for_config

log = logging.getLogger(__name__)


class ModelLoadError(UserError):
    """The model path cannot be loaded; the message says why and what to do."""


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    spec: ArchSpec
    source: str
    # Files to copy into an export as they are (tokenizer files of the source directory).
    tokenizer_files: tuple[Path, ...] = ()


# Copied into an export as they are. A checkpoint whose tokenizer is remote code (InternLM2) has none
# copied: the export saves the converted tokenizer instead, so it holds no .py file and no auto_map.
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
)


def read_config_json(path: Path) -> dict[str, Any]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(
            f"{path} is not a model directory: it has no config.json (pass a Hugging Face model directory or a .gguf file)"
        )
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{cfg_path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(str(f)))
        return sd
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelLoadError(f"{path} has a config.json but no *.safetensors or pytorch_model*.bin weights")
    sd = {}
    for f in bins:
        sd.update(torch.load(f, map_location="cpu", weights_only=True))
    return sd


def _load_tokenizer(path: Path, gguf_file: Optional[str] = None):
    from transformers import AutoTokenizer

    if gguf_file is None and tokenizer_convert.names_remote_tokenizer(path):
        # AutoTokenizer would ask "Do you wish to run the custom code?" or raise: convert instead.
        return tokenizer_convert.load_converted(path)
    try:
        if gguf_file:
            return AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file)
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}".splitlines()[0]) from None


def _load_internlm2(path: Path, cfg: dict[str, Any], dtype: torch.dtype):
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**internlm2.llama_config_dict(cfg))
    with init_empty_weights(include_buffers=False):
        model = LlamaForCausalLM(config)
    sd = internlm2.to_llama_state_dict(_read_state_dict(path), cfg)
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    sd = {k: v.to(dtype) for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ModelLoadError(
            f"{path}: InternLM2 weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def load_fp_model(model_path: str | os.PathLike, dtype: torch.dtype = torch.float16) -> LoadedModel:
    """Load MODEL (HF directory or .gguf file) on the CPU in `dtype`, with its registry entry."""
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if not path.exists():
        raise ModelLoadError(f"{path} does not exist: pass a Hugging Face model directory or a .gguf file")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf: pass a model directory or a .gguf file")
        try:
            import gguf  # noqa: F401
        except ImportError:
            raise ModelLoadError("loading .gguf files needs the gguf package: pip install 'quantkit[demo]'") from None
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        # The GGUF weights are dequantized now; the config must not claim otherwise on export.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        spec = spec_for_config(model.config)
        tok = _load_tokenizer(path.parent, gguf_file=path.name)
        return LoadedModel(model.eval(), tok, spec, str(path))
    cfg = read_config_json(path)
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "unknown")
        raise ModelLoadError(f"{path} is already quantized ({method}); quantize the original full-precision model")
    spec = spec_for_config(cfg)
    tok_files = tuple(path / f for f in _TOKENIZER_FILES if (path / f).is_file())
    if tokenizer_convert.names_remote_tokenizer(path):
        tok_files = ()  # the export saves the converted tokenizer
    if spec.name == "internlm2":
        model = _load_internlm2(path, cfg, dtype)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load {path}: {exc}".splitlines()[0]) from None
    return LoadedModel(model.eval(), _load_tokenizer(path), spec, str(path), tok_files)
