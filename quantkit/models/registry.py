"""The architecture registry: what a decoder block is made of, as data.

Each family is one `ArchSpec`: where the decoder layers live, which linears a block has, and the
AWQ scaling groups — the op whose output feeds some linears (scales fold into it), those linears,
and the module whose output measures the loss of a candidate scaling.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from quantkit.config import UserError


class UnsupportedArchitecture(UserError):
    """The checkpoint's architecture has no registry entry."""


@dataclass(frozen=True)
class ScaleGroup:
    """`prev` (a norm or linear, relative to the block) feeds `linears`; `loss_module` measures them.

    `needs_equal_shapes` marks v→o, valid only when every o input channel has its own v output row
    (no grouped-query attention), unless the driver handles GQA itself. `prev_part` (index, count)
    names the one of `count` equal slices of prev's outputs that feeds the linears, when only a part
    does: (1, 2) for the up half of a fused gate_up_proj, which down_proj reads (through silu(gate)·up).
    """

    prev: str
    linears: tuple[str, ...]
    loss_module: str
    needs_equal_shapes: bool = False
    prev_part: Optional[tuple[int, int]] = None


@dataclass(frozen=True)
class SourceLayout:
    """An export written in the source checkpoint's own layout rather than the converted one (LLaVA: the
    language model quantized inside the multimodal checkpoint, its other parts copied as they are), so
    that the readers of the source read the export. `name` maps a converted tensor name back to the
    source's, `passthrough` picks the source tensors copied byte for byte, `config(source config.json,
    quantization_config)` gives the export's config.json. Its `Conversion.state_dict` only renames, so
    the engine reads such exports (packed tensors included) through it."""

    name: Callable[[str], str]
    passthrough: Callable[[str], bool]
    config: Callable[[dict, dict], dict]


@dataclass(frozen=True)
class Conversion:
    """How a family whose modeling code ships as remote code runs in another family's layout.

    Nothing of the checkpoint's own code is imported: `config` maps its config.json to a transformers
    config of the target layout (e.g. a LlamaConfig), `state_dict` renames/splits a set of its tensors
    (one decoder block at a time, or the tensors outside the blocks) into the target's names, and
    `tokenizer`, when given, builds a fast tokenizer from the checkpoint's files (else the generic
    sentencepiece conversion of `models/tokenizer_convert.py` applies when its tokenizer is remote code).
    `generation`, when given, adjusts the GenerationConfig read from the checkpoint directory (stop tokens
    that its remote chat code knows but its generation_config.json lacks, e.g. Qwen's <|im_end|>).
    """

    config: Callable[[dict], Any]
    state_dict: Callable[[dict, dict], dict]
    # The prefix of its decoder blocks' tensor names (followed by ".N."), in the source checkpoint.
    source_layers_path: str = "model.layers"
    tokenizer: Optional[Callable[[Path], Any]] = None
    # Set when the export keeps the source layout (else it is written in the converted one).
    export_layout: Optional[SourceLayout] = None
    generation: Optional[Callable[[Any, Path], Any]] = None


def split_fused_qkv(sd: dict, fused: "re.Pattern[str]", split: Callable[[str, Any], tuple],
                    renames: tuple[tuple[str, str], ...] = (), skip: tuple[str, ...] = ()) -> dict:
    """A state dict in Llama's names: each tensor whose name matches `fused` (groups: the block's prefix,
    the tensor's kind, e.g. weight) split by `split(name, tensor)` into q, k and v; names rewritten by
    `renames` ((pattern, replacement) in order, the prefix of a split tensor too); names ending in
    `skip` dropped."""
    def renamed(name: str) -> str:
        for pattern, repl in renames:
            name = re.sub(pattern, repl, name)
        return name

    out = {}
    for name, tensor in sd.items():
        if name.endswith(skip):
            continue
        m = fused.match(name)
        if m:
            for proj, t in zip(("q_proj", "k_proj", "v_proj"), split(name, tensor)):
                out[f"{renamed(m.group(1))}.self_attn.{proj}.{m.group(2)}"] = t
        else:
            out[renamed(name)] = tensor
    return out


@dataclass(frozen=True)
class ArchSpec:
    """One model family."""

    name: str
    architectures: tuple[str, ...]
    layers_path: str = "model.layers"
    linears: tuple[str, ...] = ()
    groups: tuple[ScaleGroup, ...] = ()
    # Modules never quantized (their names as the export lists them in modules_to_not_convert).
    keep_fp: tuple[str, ...] = ("lm_head",)
    # The architecture name written into an exported config.json (InternLM2 exports as Llama).
    export_architecture: Optional[str] = None
    # Set for families run in another family's layout (their names below are the target's names).
    conversion: Optional[Conversion] = None
    notes: str = ""
    # What the engine's decoder builds beyond a Llama block.
    qkv_bias: bool = False                 # q/k/v carry a bias even where the config's attention_bias is off
    o_proj_bias: Optional[bool] = None     # None: as the config's attention_bias
    qk_norm: bool = False                  # per-head RMSNorm on q and k after the projections (Qwen3)
    rope_interleaved: bool = False         # rotary on adjacent pairs of half of each head (GLM)
    vision: bool = False                   # an image-text model (LLaVA): the engine loads its vision tower
    # Linears whose clip range AWQ never searches: a per-linear output error says nothing about how the
    # softmax reacts to clipped queries and keys (the published method skips them as well).
    no_clip: tuple[str, ...] = ("q_proj", "k_proj", "wq", "wk", "query", "key")
    # For families whose exports transformers loads under another class: its state dict from ours.
    transformers_state_dict: Optional[Callable[[dict], dict]] = None


_REGISTRY: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    for arch in spec.architectures:
        _REGISTRY[arch] = spec
    return spec


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def spec_for_architecture(architecture: str) -> ArchSpec:
    """The registry entry for an architecture name such as 'LlamaForCausalLM'."""
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise UnsupportedArchitecture(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        ) from None


def spec_for_config(config: Any) -> ArchSpec:
    """The registry entry for a transformers config (or a config.json mapping)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    archs = get("architectures") or []
    for arch in archs:
        if arch in _REGISTRY:
            return _REGISTRY[arch]
    model_type = get("model_type")
    for spec in _REGISTRY.values():
        if spec.name == model_type:
            return spec
    name = archs[0] if archs else (model_type or "unknown")
    return spec_for_architecture(name)
