"""Turn a model plus its quantized linears into checkpoint tensors and config, and write them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import torch

from quantkit.config import QuantizeConfig
from quantkit.formats import compressed_tensors
from quantkit.formats.checkpoint import write_checkpoint
from quantkit.formats.kv_stats import FILE_NAME as KV_STATS_FILE
from quantkit.formats.layout import WeightLayout
from quantkit.formats.registry import FORMATS
from quantkit.models.lazy import TensorReader
from quantkit.models.loading import LoadedModel, read_config_json
from quantkit.models.registry import ArchSpec, SourceLayout
from quantkit.quantize.primitives import QuantizedWeight

ExtraFiles = dict[str, dict[str, torch.Tensor]]
# Shards of an export: a shard is held in host memory until it is written, so smaller than the
# usual 5 GB keeps a 13B model's streaming pass within a few GB of host memory.
STREAM_SHARD_BYTES = 1024**3


def weight_layout(config: QuantizeConfig) -> WeightLayout:
    """The layout that both the packed tensors and the quantization_config of an export record."""
    return FORMATS[config.resolved_format].layout_of(config)


def packed_tensors(qweights: dict[str, QuantizedWeight], config: QuantizeConfig) -> dict[str, torch.Tensor]:
    """Packed tensors for every quantized linear, named `<module>.<tensor>` as the format wants, on the host.

    The bit packing runs on the accelerator when there is one (`config.device`, else CUDA when
    present): on a 7B model it is about 35 s of host time and well under a second there."""
    out: dict[str, torch.Tensor] = {}
    fmt, layout = FORMATS[config.resolved_format], weight_layout(config)
    if config.device:
        device = torch.device(config.device)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name, qw in qweights.items():
        q, zeros, scales, input_scale = (None if t is None else t.to(device)
                                         for t in (qw.q, qw.zeros, qw.scales, getattr(qw, "input_scale", None)))
        packed = fmt.pack(q, zeros, scales, layout, input_scale=input_scale)
        for key, t in packed.items():
            out[f"{name}.{key}"] = t.cpu()
    return out


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float16).contiguous() if t.is_floating_point() else t.detach().contiguous()


def stem_tensors(model: torch.nn.Module, spec: ArchSpec) -> dict[str, torch.Tensor]:
    """The tensors outside the decoder blocks (embeddings, final norm, lm_head unless tied), fp16."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    blocks = f"{spec.layers_path}."
    return {key: _fp16(t) for key, t in model.state_dict().items()
            if not key.startswith(blocks) and not (tied and key == "lm_head.weight")}


def block_tensors(layer: torch.nn.Module, prefix: str, qweights: dict[str, QuantizedWeight],
                  config: QuantizeConfig) -> dict[str, torch.Tensor]:
    """One quantized block's checkpoint tensors on the host: its linears packed (where `packed_tensors`
    packs), its other tensors (norms, biases) in fp16. `qweights` are keyed by full module name."""
    replaced = {f"{name[len(prefix) + 1:]}.weight" for name in qweights}
    out = {f"{prefix}.{key}": _fp16(t).cpu() for key, t in layer.state_dict().items() if key not in replaced}
    out.update(packed_tensors(qweights, config))
    return out


def export_config(loaded: LoadedModel, config: QuantizeConfig, kv_cache_scheme: bool = False) -> dict[str, Any]:
    """config.json of the export: the model's, in the exported architecture, with quantization_config
    (holding a compressed-tensors `kv_cache_scheme` when `kv_cache_scheme`, see `vllm_kv_scales`)."""
    cfg = loaded.model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    if loaded.spec.export_architecture:
        cfg["architectures"] = [loaded.spec.export_architecture]
        # The converted config's own model_type ("llama" for InternLM2, "qwen2" for Qwen v1).
        cfg["model_type"] = getattr(loaded.model.config, "model_type", None) or "llama"
        cfg.pop("auto_map", None)
    elif not cfg.get("architectures"):
        # A model read from a .gguf has none; vLLM and transformers pick the model class from it.
        cfg["architectures"] = [type(loaded.model).__name__]
    cfg["torch_dtype"] = "float16"
    cfg["dtype"] = "float16"
    add_legacy_rope_keys(cfg)
    cfg["quantization_config"] = FORMATS[config.resolved_format].write_config(weight_layout(config),
                                                                              list(loaded.spec.keep_fp))
    if kv_cache_scheme:
        cfg["quantization_config"]["kv_cache_scheme"] = compressed_tensors.kv_cache_scheme()
    layout = source_layout(loaded)
    if layout is not None:  # the source's config.json, with this quantization_config
        return layout.config(read_config_json(Path(loaded.source)), cfg["quantization_config"])
    return cfg


def add_legacy_rope_keys(cfg: dict[str, Any]) -> None:
    """transformers 5 writes the rotary settings only as `rope_parameters`; readers on transformers 4 (vLLM
    and lmdeploy builds among them) know `rope_theta`, `rope_scaling` and `partial_rotary_factor` at the
    top level and would otherwise take the default base (10,000). Write both spellings."""
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict):
        return
    if "rope_theta" in params:
        cfg.setdefault("rope_theta", params["rope_theta"])
    if "partial_rotary_factor" in params:
        cfg.setdefault("partial_rotary_factor", params["partial_rotary_factor"])
    if params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
        cfg.setdefault("rope_scaling", scaling)


def source_layout(loaded: LoadedModel) -> Optional[SourceLayout]:
    """How an export of `loaded` is written in its source's layout (LLaVA), or None for the usual export."""
    conversion = loaded.spec.conversion
    return conversion.export_layout if conversion is not None else None


def source_tensors(loaded: LoadedModel, layout: SourceLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """The source tensors an export in the source layout copies as they are (LLaVA's vision tower), one at a time."""
    reader = TensorReader(Path(loaded.source))
    for name in reader.names():
        if layout.passthrough(name):
            yield name, reader.read([name])[name]


def vllm_kv_scales(model: torch.nn.Module, config: QuantizeConfig, kv_stats: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The KV statistics as the per-layer `k_scale` / `v_scale` tensors that vLLM reads, for a
    compressed-tensors export that has statistics (else {}). vLLM takes them only with a
    compressed-tensors kv_cache_scheme (fp8); for quant_method awq it loads none."""
    if kv_stats is None or not FORMATS[config.resolved_format].writes_kv_scales:
        return {}
    attention = [name for name, module in model.named_modules() if hasattr(module, "k_proj") and hasattr(module, "v_proj")]
    if len(attention) != kv_stats["k_absmax"].shape[0]:
        return {}  # not a layout whose attention modules map one to one onto the statistics' layers
    return compressed_tensors.kv_cache_scales(attention, kv_stats["k_absmax"], kv_stats["v_absmax"])


def write_export(
    loaded: LoadedModel, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], config: QuantizeConfig,
    work_dir: Path, report: dict[str, Any], overwrite: bool = False,
    extra_tensor_files: ExtraFiles | Callable[[], ExtraFiles] | None = None,
) -> Path:
    """Write the checkpoint tensors, tokenizer, generation config and quant_report.json atomically.

    `tensors` may be (name, tensor) pairs produced while the shards are written (the streaming
    pass); `extra_tensor_files` ({relative path: tensors}) may then be a function, called once they
    are all consumed, for what the same pass gathered (KV statistics)."""
    extra: ExtraFiles = {}
    cfg = export_config(loaded, config)

    layout = source_layout(loaded)
    rename = layout.name if layout is not None else (lambda name: name)

    def checked() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in (tensors.items() if isinstance(tensors, Mapping) else tensors):
            # (e4m3 has no isfinite; its NaN survives the cast to fp16)
            if t.is_floating_point() and not torch.isfinite(t if t.element_size() > 1 else t.half()).all():
                raise ValueError(f"refusing to write a checkpoint with NaN or Inf values (in {name})")
            yield rename(name), t
        extra.update((extra_tensor_files() if callable(extra_tensor_files) else extra_tensor_files) or {})
        kv_scales = vllm_kv_scales(loaded.model, config, extra.get(KV_STATS_FILE))
        if kv_scales:  # config.json is serialised after the tensors are consumed
            cfg.update(export_config(loaded, config, kv_cache_scheme=True))
        yield from ((rename(name), t) for name, t in kv_scales.items())
        if layout is not None:
            yield from source_tensors(loaded, layout)

    writers = []
    if loaded.tokenizer_files:
        files = {p.name: p for p in loaded.tokenizer_files}
    else:
        files = {}
        writers.append(lambda d: loaded.tokenizer.save_pretrained(str(d)))
    gen = getattr(loaded.model, "generation_config", None)
    if gen is not None:
        writers.append(lambda d: gen.save_pretrained(str(d)))

    def write_extra(d: Path) -> None:
        from safetensors.torch import save_file

        for fname, tdict in extra.items():
            (d / fname).parent.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in tdict.items()}, str(d / fname))

    writers.append(write_extra)
    return write_checkpoint(
        Path(work_dir), checked(), cfg, overwrite=overwrite, files=files,
        json_files={"quant_report.json": report}, writers=writers, shard_bytes=STREAM_SHARD_BYTES,
    )
