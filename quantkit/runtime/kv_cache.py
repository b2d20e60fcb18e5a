"""A quantized KV cache for transformers 5.x: int8 (KV8) or packed int4 (KV4) K and V.

Each layer holds two streams (kv_stream.py). Values, and keys in per-token modes, are coded as they
are written and attention reads them back decoded, the new tokens included. Int4 keys online are
coded per channel over groups of 32 tokens (KIVI), the group being filled staying in full precision.
Perplexity feeds each window in chunks of `KVCacheFactory.chunk` tokens (the key group; the whole
window for per-token modes), which gives every query exactly the states it would read when decoding
token by token through the cache (see quantkit.eval.perplexity).

`attach_kv_cache(model, …)` makes `model.generate` and `model(…, use_cache=True)` use a fresh
`QuantizedKVCache` whenever the caller passes none; `kv_cache_factory(model)` gives the factory.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from quantkit.config import ConfigError, KVQuantConfig
from quantkit.formats.kv_stats import KVStats, KVStatsError, kv_stats_file, read_kv_stats
from quantkit.runtime.kv_codec import StateCodec, static_codec
from quantkit.runtime.kv_stream import ChannelGroupStream, TokenStream

# transformers ≥ 5.2x names the forward/generate argument `cache`; earlier 5.x `past_key_values`.
CACHE_ARG_NAMES = ("cache", "past_key_values")
_ATTR = "_quantkit_kv_factory"
Stream = Union[TokenStream, ChannelGroupStream]


class QuantizedKVLayer(CacheLayerMixin):
    """One attention layer's cache: a key stream and a value stream."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, keys: Stream, values: Stream) -> None:
        super().__init__()
        self.k_stream, self.v_stream = keys, values
        self.head_dim = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device, self.head_dim = key_states.dtype, key_states.device, key_states.shape[-1]
        self.k_stream.to_device(self.device)
        self.v_stream.to_device(self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new states; return all keys and values as attention must read them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.k_stream.append(key_states), self.v_stream.append(value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.k_stream.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.k_stream.length

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        """Bytes held: codes, scales and zeros (per token, per group or static), full-precision remainders."""
        return self.k_stream.nbytes() + self.v_stream.nbytes()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.k_stream.apply(fn)
        self.v_stream.apply(fn)

    def reset(self) -> None:
        self.k_stream, self.v_stream = self._fresh(self.k_stream), self._fresh(self.v_stream)

    @staticmethod
    def _fresh(stream: Stream) -> Stream:
        if isinstance(stream, ChannelGroupStream):
            return ChannelGroupStream(stream.bits, stream.group)
        return TokenStream(stream.codec)

    def crop(self, tokens_to_remove: int) -> None:
        """Negative: drop that many trailing tokens; positive (older transformers): keep that many."""
        length = self.get_seq_length()
        keep = max(0, length + tokens_to_remove) if tokens_to_remove < 0 else min(tokens_to_remove, length)
        self.k_stream.crop(keep)
        self.v_stream.crop(keep)

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
    """A transformers `Cache` whose layers are `QuantizedKVLayer`s."""

    def __init__(self, streams: list[tuple[Stream, Stream]]) -> None:
        super().__init__(layers=[QuantizedKVLayer(k, v) for k, v in streams])

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def dense_nbytes(self, dtype: torch.dtype = torch.float16) -> int:
        """Bytes the same cached K and V would take unquantized in `dtype` (the baseline)."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(2 * layer.get_seq_length() * layer.head_dim * self._heads(layer) * size for layer in self.layers)

    @staticmethod
    def _heads(layer: QuantizedKVLayer) -> int:
        s = layer.v_stream
        return 0 if s.parts is None else s.parts["q"].shape[0] * s.parts["q"].shape[1]


@dataclass(frozen=True)
class KVCacheSettings:
    """What a quantized cache does: `bits` 8|4 and `scales` online|static.

    Online, keys are coded per channel over groups of `key_group` tokens (None: 32 for 4 bits, where
    per-token int4 keys lose too much; 0, per token, for 8 bits, as lmdeploy does); values per token.
    Static scales come from `stats`: one per head and channel for K and V (`static_per_channel`; on
    SmolLM2 KV4 that is +3 % ppl against +63 % with one per head), else one per head.
    """

    bits: int = 8
    scales: str = "online"
    stats: Optional[KVStats] = None
    key_group: Optional[int] = None
    static_per_channel: bool = True

    def __post_init__(self) -> None:
        KVQuantConfig(self.bits, self.scales)  # the one place that says which values are valid
        if self.bits == 16:
            raise ValueError("KVCacheSettings is for quantized caches; 16 bits means no KVCacheSettings")
        if self.key_group is not None and self.key_group < 0:
            raise ValueError(f"key_group must be ≥ 0 (0 codes keys per token), not {self.key_group}")
        if self.scales == "static" and self.stats is None:
            raise KVStatsError(
                "--kv-scales static needs calibration statistics (quantkit/kv_stats.safetensors): run "
                "`quantkit kv-calibrate MODEL --calib-dataset ptb` first, or use --kv-scales online"
            )

    @property
    def group(self) -> int:
        """Tokens per key group (online); 0 means keys are coded per token."""
        if self.scales == "static":
            return 0
        return (32 if self.bits == 4 else 0) if self.key_group is None else self.key_group

    def describe(self) -> str:
        if self.group:
            return f"KV{self.bits} online (K per channel, g{self.group})"
        if self.scales == "static" and not self.static_per_channel:
            return f"KV{self.bits} static (per head)"
        return f"KV{self.bits} {self.scales}"


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
        if settings.bits == 4 and head_dim % 2:
            raise ConfigError(f"KV4 packs two codes per byte and needs an even head_dim, not {head_dim}: use --kv-bits 8")
        self.settings = settings
        bits = settings.bits
        if settings.scales == "static":
            per_channel = settings.static_per_channel
            self.codecs = [(static_codec(st.k_min[i], st.k_max[i], bits, per_channel),
                            static_codec(st.v_min[i], st.v_max[i], bits, per_channel))
                           for i in range(self.num_layers)]
        else:
            self.codecs = [(StateCodec(bits), StateCodec(bits))] * self.num_layers

    @property
    def chunk(self) -> Optional[int]:
        """Tokens per forward that reproduce decoding in evaluation: the key group, or None (any)."""
        return self.settings.group or None

    def __call__(self) -> QuantizedKVCache:
        group = self.settings.group
        streams = [(ChannelGroupStream(self.settings.bits, group) if group else TokenStream(k), TokenStream(v))
                   for k, v in self.codecs]
        return QuantizedKVCache(streams)


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
    if path.is_dir() and kv_stats_file(path) is None:
        return None
    return read_kv_stats(path)


def attach_kv_cache(model: torch.nn.Module, stats_source: Any, kv_bits: Optional[int], kv_scales: str = "online",
                    **settings: Any) -> Optional[KVCacheFactory]:
    """Make `model` use a quantized cache of `kv_bits` (8 or 4; 16/None detaches) wherever it caches.

    `stats_source` is a checkpoint directory, a statistics .safetensors file, a `KVStats` or None;
    static scales need statistics. Further `settings` go to `KVCacheSettings` (key_group, …).
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
