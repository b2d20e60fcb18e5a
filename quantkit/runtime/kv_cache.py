"""A quantized KV cache for transformers 5.x: int8 (KV8) or packed int4 (KV4) K and V.

`update` codes the new states, appends the codes and returns the whole cache *decoded*, the new
tokens included: every query attends to quantized K/V, as in an engine that writes the cache before
its attention kernel reads it. So one forward over a window with a fresh cache computes exactly what
token-by-token decoding with that cache would (per-token and static codes do not depend on other
tokens), which is how perplexity measures the cache's error (see quantkit.eval.perplexity).

`attach_kv_cache(model, …)` makes `model.generate` and `model(…, use_cache=True)` use a fresh
`QuantizedKVCache` whenever the caller passes none; `kv_cache_factory(model)` gives the factory.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from quantkit.config import KVQuantConfig
from quantkit.formats.kv_stats import FILE_NAME, KVStats, KVStatsError, read_kv_stats
from quantkit.runtime.kv_codec import Parts, StateCodec, channel_factor, static_codec

# transformers ≥ 5.2x names the forward/generate argument `cache`; earlier 5.x `past_key_values`.
CACHE_ARG_NAMES = ("cache", "past_key_values")
_ATTR = "_quantkit_kv_factory"


def _cat(old: Optional[Parts], new: Parts) -> Parts:
    return new if old is None else {k: torch.cat([old[k], new[k]], dim=-2) for k in new}


def _map(parts: Optional[Parts], fn) -> Optional[Parts]:
    return None if parts is None else {k: fn(v) for k, v in parts.items()}


class QuantizedKVLayer(CacheLayerMixin):
    """One attention layer's cache: codes plus per-token scales, appended along the token axis."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, key_codec: StateCodec, value_codec: StateCodec) -> None:
        super().__init__()
        self.key_codec, self.value_codec = key_codec, value_codec
        self.k_parts: Optional[Parts] = None
        self.v_parts: Optional[Parts] = None
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device, self.head_dim = key_states.dtype, key_states.device, key_states.shape[-1]
        self.key_codec, self.value_codec = self.key_codec.to(self.device), self.value_codec.to(self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the codes of the new states; return all keys and values decoded, new ones included."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.k_parts = _cat(self.k_parts, self.key_codec.encode(key_states))
        self.v_parts = _cat(self.v_parts, self.value_codec.encode(value_states))
        self.length += key_states.shape[-2]
        dtype = key_states.dtype
        return self.key_codec.decode(self.k_parts, dtype), self.value_codec.decode(self.v_parts, dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        """Bytes held for the cached tokens: codes, per-token scales and zeros, and the layer's constants."""
        held = sum(t.numel() * t.element_size() for p in (self.k_parts, self.v_parts) if p for t in p.values())
        return held + self.key_codec.constant_nbytes() + self.value_codec.constant_nbytes()

    def _apply(self, fn) -> None:
        self.k_parts, self.v_parts = _map(self.k_parts, fn), _map(self.v_parts, fn)

    def reset(self) -> None:
        self.k_parts = self.v_parts = None
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Negative: drop that many trailing tokens; positive (older transformers): keep that many."""
        keep = self.length + tokens_to_remove if tokens_to_remove < 0 else min(tokens_to_remove, self.length)
        if keep == self.length or self.k_parts is None:
            return
        self._apply(lambda t: t[..., :keep, :])
        self.length = keep

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices, ...])

    def offload(self) -> None:
        self._apply(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized:
            self._apply(lambda t: t.to(self.device, non_blocking=True))


class QuantizedKVCache(Cache):
    """A transformers `Cache` whose layers are `QuantizedKVLayer`s (one pair of codecs per layer)."""

    def __init__(self, codecs: list[tuple[StateCodec, StateCodec]]) -> None:
        super().__init__(layers=[QuantizedKVLayer(k, v) for k, v in codecs])

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def dense_nbytes(self, dtype: torch.dtype = torch.float16) -> int:
        """Bytes the same cached K and V would take unquantized in `dtype` (the baseline)."""
        size = torch.empty((), dtype=dtype).element_size()
        total = 0
        for layer in self.layers:
            if layer.k_parts is not None:
                b, h, t, _ = layer.k_parts["q"].shape
                total += 2 * b * h * t * layer.head_dim * size
        return total


@dataclass(frozen=True)
class KVCacheSettings:
    """What a quantized cache does: `bits` 8|4, `scales` online|static, and how keys use the statistics.

    `key_channels` (None: on for 4 bits when statistics exist) gives keys per-channel treatment: static
    scales per head *and channel*, or, online, per-channel normalisation by absmax^`alpha` before the
    per-token code. Values are always coded per head (per token online).
    """

    bits: int = 8
    scales: str = "online"
    stats: Optional[KVStats] = None
    key_channels: Optional[bool] = None
    alpha: float = 0.5

    def __post_init__(self) -> None:
        KVQuantConfig(self.bits, self.scales)  # the one place that says which values are valid
        if self.bits == 16:
            raise ValueError("KVCacheSettings is for quantized caches; 16 bits means no KVCacheSettings")
        if self.scales == "static" and self.stats is None:
            raise KVStatsError(
                "--kv-scales static needs calibration statistics (kv_stats.safetensors): run "
                "`quantkit kv-calibrate MODEL --calib-dataset ptb` first, or use --kv-scales online"
            )

    @property
    def use_key_channels(self) -> bool:
        if self.stats is None:
            return False
        return self.bits == 4 if self.key_channels is None else self.key_channels

    def describe(self) -> str:
        keys = " keys per channel" if self.use_key_channels else ""
        return f"KV{self.bits} {self.scales}{keys}"


def layer_codecs(settings: KVCacheSettings, num_layers: int) -> list[tuple[StateCodec, StateCodec]]:
    """One (key, value) codec pair per layer."""
    s, bits = settings.stats, settings.bits
    out = []
    for i in range(num_layers):
        if settings.scales == "static":
            k = static_codec(s.k_min[i], s.k_max[i], bits, per_channel=settings.use_key_channels)
            v = static_codec(s.v_min[i], s.v_max[i], bits, per_channel=False)
        else:
            k = StateCodec(bits, channel=channel_factor(s.k_absmax[i], settings.alpha) if settings.use_key_channels else None)
            v = StateCodec(bits)
        out.append((k, v))
    return out


class KVCacheFactory:
    """Makes a fresh `QuantizedKVCache` for a model (one per generate call or per evaluated window)."""

    def __init__(self, config: Any, settings: KVCacheSettings) -> None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.num_layers = int(text.num_hidden_layers)
        heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        st = settings.stats
        if st is not None and (st.num_layers, st.num_kv_heads, st.head_dim) != (self.num_layers, heads, head_dim):
            raise KVStatsError(
                f"the KV statistics are for {st.num_layers} layers x {st.num_kv_heads} heads x {st.head_dim} dims, "
                f"the model has {self.num_layers} x {heads} x {head_dim}: recalibrate with `quantkit kv-calibrate`"
            )
        self.settings = settings
        self.codecs = layer_codecs(settings, self.num_layers)

    def __call__(self) -> QuantizedKVCache:
        return QuantizedKVCache(self.codecs)


def cache_arg_name(model: torch.nn.Module) -> str:
    """The keyword under which this model's forward takes a cache."""
    params = inspect.signature(type(model).forward).parameters
    return next((n for n in CACHE_ARG_NAMES if n in params), "past_key_values")


def _has_cache(kwargs: dict[str, Any]) -> bool:
    return any(kwargs.get(n) is not None for n in CACHE_ARG_NAMES)


def _find_stats(source: Any) -> Optional[KVStats]:
    """Statistics from a KVStats, a stats file, or a checkpoint directory that has one (else None)."""
    if source is None or isinstance(source, KVStats):
        return source
    path = Path(source)
    if path.is_dir() and not (path / FILE_NAME).is_file():
        return None
    return read_kv_stats(path)


def attach_kv_cache(model: torch.nn.Module, stats_source: Any, kv_bits: Optional[int], kv_scales: str = "online",
                    **settings: Any) -> Optional[KVCacheFactory]:
    """Make `model` use a quantized cache of `kv_bits` (8 or 4; 16/None detaches) wherever it caches.

    `stats_source` is a checkpoint directory, a kv_stats.safetensors path, a `KVStats` or None;
    static scales need statistics. Further `settings` go to `KVCacheSettings` (key_channels, alpha).
    Returns the factory, which `kv_cache_factory(model)` also gives.
    """
    KVQuantConfig(16 if kv_bits is None else kv_bits, kv_scales)
    detach_kv_cache(model)
    if kv_bits is None or kv_bits == 16:
        return None
    factory = KVCacheFactory(model.config, KVCacheSettings(kv_bits, kv_scales, _find_stats(stats_source), **settings))
    name = cache_arg_name(model)
    originals = {"generate": model.generate, "forward": model.forward}

    @functools.wraps(originals["generate"])
    def generate(*args: Any, **kwargs: Any):
        if kwargs.get("use_cache", True) is not False and not _has_cache(kwargs):
            kwargs[name] = factory()
        return originals["generate"](*args, **kwargs)

    @functools.wraps(originals["forward"])
    def forward(*args: Any, **kwargs: Any):
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(model.config, "use_cache", False)
        if use_cache and not _has_cache(kwargs):
            kwargs[name] = factory()
        return originals["forward"](*args, **kwargs)

    # Instance attributes shadow the class's methods; detach_kv_cache deletes them again.
    model.generate, model.forward = generate, forward
    setattr(model, _ATTR, factory)
    return factory


def detach_kv_cache(model: torch.nn.Module) -> None:
    """Undo `attach_kv_cache` (a no-op on a model without one)."""
    if getattr(model, _ATTR, None) is None:
        return
    for name in ("generate", "forward", _ATTR):
        model.__dict__.pop(name, None)


def kv_cache_factory(model: torch.nn.Module) -> Optional[KVCacheFactory]:
    """The factory `attach_kv_cache` put on `model`, or None."""
    return getattr(model, _ATTR, None)
