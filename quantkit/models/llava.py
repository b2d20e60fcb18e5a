"""LLaVA and LLaVA-NeXT in the llava-hf layout: the language model is quantized and run as a Llama-layout
decoder; the vision tower, the projector and NeXT's `image_newline` stay as the checkpoint stores them.

llava-hf checkpoints (llava-1.5-7b-hf, llava-v1.6-vicuna-7b-hf) name their tensors
`language_model.model.layers.N.…`, `language_model.model.embed_tokens/norm`, `language_model.lm_head`,
`vision_tower.vision_model.…` (`vision_tower.…` when transformers 5 saved them), `multi_modal_projector.…`
and `image_newline`. Quantization and the engine see only the language model, renamed to Llama names
(`model.…`, `lm_head`); the export is written back in the source layout, the language model's linears
packed and every other tensor copied byte for byte, with a config.json that is the source's plus a
quantization_config naming the vision parts as unquantized in both readers' spellings: vLLM's modules
are `vision_tower.vision_model.…`, `multi_modal_projector.…`, `language_model.lm_head`; transformers 5's
`model.vision_tower.…`, `model.multi_modal_projector.…`, `lm_head`.
"""

from __future__ import annotations

from typing import Any

import torch

from quantkit.models.llama_family import LLAMA_GROUPS, LLAMA_LINEARS
from quantkit.models.registry import ArchSpec, Conversion, SourceLayout, register

# Source-name prefix → the converted language model's prefix.
_LANGUAGE = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
LANGUAGE_PREFIX = "language_model."
# vLLM skips an AWQ layer whose name contains one of these; transformers one whose name starts (at a
# module boundary) or ends with one.
AWQ_NOT_CONVERTED = ["lm_head", "vision_tower", "multi_modal_projector", "model.vision_tower",
                     "model.multi_modal_projector"]
# compressed-tensors readers match `re:` patterns with re.match against the full module name.
COMPRESSED_IGNORE = ["re:.*lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*"]


def full_config(cfg: dict[str, Any]):
    """The transformers LlavaConfig / LlavaNextConfig of a config.json mapping (llava-hf's text_config
    lists only what differs from LlamaConfig's defaults; this fills in the rest)."""
    from transformers import CONFIG_MAPPING

    cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    return CONFIG_MAPPING[cfg["model_type"]](**cfg)


def text_config(cfg: dict[str, Any]):
    """The language model's config as a causal LM of its own (LlamaConfig for vicuna, MistralConfig …)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text = full_config(cfg).text_config
    text.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[text.model_type]]
    return text


def language_state_dict(sd: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The language model's tensors under Llama names; the vision parts are left out. Names only, so
    packed tensors (qweight, weight_packed, …) of an export convert alike."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        for source, target in _LANGUAGE:
            if name.startswith(source):
                out[target + name[len(source):]] = tensor
                break
    return out


def source_name(name: str) -> str:
    """A converted language-model tensor name → its llava-hf name."""
    for source, target in _LANGUAGE:
        if name.startswith(target):
            return source + name[len(target):]
    raise ValueError(f"{name!r} is not a language-model tensor name")


def export_config(source: dict[str, Any], quantization_config: dict[str, Any]) -> dict[str, Any]:
    """The source config.json with the export's quantization_config, its vision parts left unquantized."""
    qc = dict(quantization_config)
    if qc["quant_method"] == "awq":
        qc["modules_to_not_convert"] = list(AWQ_NOT_CONVERTED)
    else:
        qc["ignore"] = list(COMPRESSED_IGNORE)
    cfg = {k: v for k, v in source.items() if k not in ("_name_or_path", "quantization_config")}
    cfg["torch_dtype"] = cfg["dtype"] = "float16"
    cfg["quantization_config"] = qc
    return cfg


def transformers_state_dict(sd: dict[str, torch.Tensor], model_keys: set[str]) -> dict[str, torch.Tensor]:
    """llava-hf tensor names → the module names of transformers 5's Llava classes (`model.language_model.…`,
    `model.vision_tower.…` without CLIP's `vision_model`, `lm_head`), as its own key mapping does on load.
    A name found under none of the candidates is kept, so the caller's strict check reports it."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        if name.startswith("language_model.model."):
            out["model.language_model." + name[len("language_model.model."):]] = tensor
        elif name.startswith("language_model.lm_head."):
            out["lm_head." + name[len("language_model.lm_head."):]] = tensor
        else:
            candidates = ["model." + name, "model." + name.replace("vision_tower.vision_model.", "vision_tower.", 1), name]
            out[next((c for c in candidates if c in model_keys), name)] = tensor
    return out


def _spec(name: str, architecture: str) -> ArchSpec:
    return register(
        ArchSpec(
            name, (architecture,), linears=LLAMA_LINEARS, groups=LLAMA_GROUPS,
            conversion=Conversion(
                config=text_config, state_dict=language_state_dict, source_layers_path="language_model.model.layers",
                export_layout=SourceLayout(name=source_name, passthrough=lambda n: not n.startswith(LANGUAGE_PREFIX),
                                           config=export_config),
            ),
            notes="the language model is quantized and run by the engine; the vision tower, projector and "
                  "image_newline are kept bit for bit; exported in the source (llava-hf) layout",
            vision=True, transformers_state_dict=transformers_state_dict,
        )
    )


LLAVA = _spec("llava", "LlavaForConditionalGeneration")
LLAVA_NEXT = _spec("llava_next", "LlavaNextForConditionalGeneration")
