"""Load a full-precision causal LM from a Hugging Face directory or a .gguf file, on the CPU.

InternLM2 checkpoints are converted to the Llama layout here (no remote code is run).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from quantkit.config import UserError, read_json
from quantkit.models import lazy, tokenizer_convert
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
    # Where a block-by-block pass gets the decoder blocks' weights (None: they are in the model).
    blocks: Optional[lazy.BlockWeights] = None


# Copied into an export as they are. A checkpoint whose tokenizer is remote code (InternLM2) has none
# copied: the export saves the converted tokenizer instead, so it holds no .py file and no auto_map.
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
    # a multimodal model's processor (LLaVA): image preprocessing, the prompt's image tokens, its chat template
    "preprocessor_config.json", "processor_config.json", "chat_template.json",
)


def read_config_json(path: Path) -> dict[str, Any]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(
            f"{path} is not a model directory: it has no config.json (pass a Hugging Face model directory or a .gguf file)"
        )
    return read_json(cfg_path, ModelLoadError)


def transformers_config(path: Path):
    """The transformers config of a model directory, without any quantization_config, or a one-line
    ModelLoadError (an unknown model_type, say) instead of transformers' traceback."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}/config.json cannot be read by transformers: {exc}".splitlines()[0]) from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def _gguf_dequantized() -> dict:
    """from_pretrained's arguments for a GGUF file unpacked to plain float weights, which quantization needs.
    transformers ≥ 5.25 otherwise keeps the blocks packed where the `kernels` package has a kernel (and warns
    that float16 is slow for those); earlier releases always unpack and have no GgufConfig."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def load_tokenizer(path: Path, gguf_file: Optional[str] = None, spec: Optional[ArchSpec] = None):
    """The tokenizer of a model directory (or of a .gguf file in it): the family's own converter where its
    tokenizer is remote code, else transformers' AutoTokenizer."""
    from transformers import AutoTokenizer

    conversion = spec.conversion if spec is not None else None
    if gguf_file is None and conversion is not None and conversion.tokenizer is not None:
        return conversion.tokenizer(path)
    if gguf_file is None and tokenizer_convert.names_remote_tokenizer(path):
        # AutoTokenizer would ask "Do you wish to run the custom code?" or raise: convert instead.
        return tokenizer_convert.load_converted(path)
    try:
        if gguf_file:
            return AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file)
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}".splitlines()[0]) from None


def _load_lazy(path: Path, cfg: dict[str, Any], spec: ArchSpec, dtype: torch.dtype):
    """The model with empty decoder blocks and a `LazyBlocks` that reads them from `path` on demand.
    A converted family (InternLM2, ...) is converted tensor by tensor as its blocks are read."""
    from transformers import AutoConfig

    source_prefix = None
    if spec.conversion is not None:
        conversion = spec.conversion
        config, source_prefix = conversion.config(cfg), conversion.source_layers_path

        def convert(sd):
            return conversion.state_dict(sd, cfg)
    else:
        config, convert = AutoConfig.from_pretrained(str(path)), None
    try:
        model, blocks = lazy.build_lazy_model(config, lazy.TensorReader(path), spec.layers_path, dtype, convert, path,
                                              source_layers_path=source_prefix)
    except lazy.WeightsMismatch as exc:
        raise ModelLoadError(str(exc)) from None
    if spec.conversion is not None and spec.conversion.generation is not None:
        model.generation_config = spec.conversion.generation(model.generation_config, path)
    return model, blocks


def load_fp_model(model_path: str | os.PathLike, dtype: torch.dtype = torch.float16, lazy_blocks: bool = False) -> LoadedModel:
    """Load MODEL (HF directory or .gguf file) on the CPU in `dtype`, with its registry entry.

    With `lazy_blocks` the decoder blocks of an HF directory are left empty and `LoadedModel.blocks`
    reads each from the checkpoint's files when a block-by-block pass asks for it (a .gguf file is
    read whole: its blocks are in memory, and the pass frees each once done)."""
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
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                     **_gguf_dequantized())
        # The GGUF weights are dequantized now; the config must not claim otherwise on export.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        spec = spec_for_config(model.config)
        tok = load_tokenizer(path.parent, gguf_file=path.name)
        return LoadedModel(model.eval(), tok, spec, str(path), blocks=lazy.BlockWeights(drop=True) if lazy_blocks else None)
    cfg = read_config_json(path)
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "unknown")
        raise ModelLoadError(f"{path} is already quantized ({method}); quantize the original full-precision model")
    spec = spec_for_config(cfg)
    tok_files = tuple(path / f for f in _TOKENIZER_FILES if (path / f).is_file())
    if tokenizer_convert.names_remote_tokenizer(path):
        tok_files = ()  # the export saves the converted tokenizer
    blocks = None
    if lazy_blocks or spec.conversion is not None:  # a converted family is never loaded by transformers
        model, blocks = _load_lazy(path, cfg, spec, dtype)
        if not lazy_blocks:
            model, blocks = lazy.load_all_blocks(model, blocks), None
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load {path}: {exc}".splitlines()[0]) from None
    return LoadedModel(model.eval(), load_tokenizer(path, spec=spec), spec, str(path), tok_files, blocks)
