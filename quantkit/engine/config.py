"""What the engine is built with (EngineConfig) and what one request asks for (SamplingParams)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from quantkit.config import ConfigError, check_kv_bits
from quantkit.engine.structured import StructuredOutput
from quantkit.kernels.settings import KernelSettings

KV_ROTATIONS = ("auto", "hadamard", "none")  # --kv-rotation; kernels/kv_rotation.py resolves auto per pool
DTYPES = ("auto", "float16", "bfloat16")  # --dtype; auto is resolved per checkpoint (engine/model.py resolve_dtype)


@dataclass
class EngineConfig:
    """How the engine sizes its KV pool and batches its steps.

    `cache_max_entry_count` is lmdeploy's: the fraction of GPU memory left after the weights and a warm-up
    that the KV pool takes. On the CPU the pool holds `num_kv_tokens` tokens (8192 when unset); set it on
    CUDA to fix the pool's size instead of taking a fraction.

    `dtype` (activations and unquantized weights): "auto" (None alike) takes the checkpoint's torch_dtype on
    CUDA (float16 for AWQ exports) and float32 on the CPU; "float16", "bfloat16" or a torch dtype is used
    as given.
    """

    kv_bits: int = 16
    block_size: int = 16
    cache_max_entry_count: float = 0.8
    num_kv_tokens: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: Optional[int] = None
    device: Optional[str] = None
    dtype: Any = "auto"
    cuda_graphs: bool = True
    # With cuda_graphs: steps with prompt tokens of up to this many tokens replay piecewise CUDA graphs
    # (engine/piecewise.py); 0 runs them eagerly.
    graph_max_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Asynchronous scheduling: step N+1 is scheduled and launched while step N runs, its input ids taken from
    # step N's sampled tokens on the device; step N's tokens are read back, stop-checked and detokenized behind
    # it. None: on for CUDA (on the CPU nothing runs behind the host, and every token would come a step late).
    async_scheduling: Optional[bool] = None
    # Warm-up traffic at start (engine/warmup.py): synthetic requests that compile every kernel a serving step
    # can meet before the first user's request. None: on for CUDA (the CPU compiles nothing).
    warmup: Optional[bool] = None
    # Where compiled kernels are kept between runs (kernels/compile_cache.py); None: $QUANTKIT_CACHE_DIR, else
    # ~/.cache/quantkit. Used on CUDA only.
    cache_dir: Optional[str] = None
    # kv_bits 8/4: "online" scales each token's K/V by its own range; "static" by per-layer per-head scales
    # from calibration statistics (`kv_stats`: a kv_stats.safetensors file, or a directory holding one;
    # Engine(path) takes the checkpoint's own when unset).
    kv_scales: str = "online"
    kv_stats: Optional[str] = None
    # How K and V are rotated before they are coded (kernels/kv_rotation.py): "auto" (a Hadamard rotation for
    # kv_bits 4 with online scales, which keeps int4 keys' outlier channels from costing quality; none
    # otherwise), "hadamard", or "none" (lmdeploy's plain per-token codes).
    kv_rotation: str = "auto"
    # Which kernels the engine's layers and KV pool run (kernels/settings.py); by default what the
    # QUANTKIT_KERNEL / _DECODE_KERNEL / _GLUON / _PDL / _DISPATCH_TABLE variables ask for, read here once.
    kernels: KernelSettings = field(default_factory=KernelSettings.from_env)

    def __post_init__(self) -> None:
        check_kv_bits(self.kv_bits)
        if self.block_size < 1:
            raise ConfigError(f"block_size {self.block_size} must be ≥ 1 (16 is usual).")
        if not 0 < self.cache_max_entry_count <= 1:
            raise ConfigError(f"--cache-max-entry-count {self.cache_max_entry_count} must be in (0, 1], "
                              "the fraction of free GPU memory the KV cache takes (0.8 is usual).")
        if self.num_kv_tokens is not None and self.num_kv_tokens < self.block_size:
            raise ConfigError(f"num_kv_tokens {self.num_kv_tokens} is smaller than one block "
                              f"({self.block_size} tokens): raise it.")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be ≥ 1.")
        if not 0 <= self.graph_max_tokens <= 2048:
            raise ConfigError(f"--graph-max-tokens {self.graph_max_tokens} must be in [0, 2048] (0 turns the "
                              "prefill graphs off).")
        if self.kv_scales not in ("online", "static"):
            raise ConfigError(f"--kv-scales {self.kv_scales!r} is not supported: choose online or static.")
        if self.kv_rotation not in KV_ROTATIONS:
            raise ConfigError(f"--kv-rotation {self.kv_rotation!r} is not supported: choose auto, hadamard or none.")
        if self.kv_rotation == "hadamard" and self.static_kv_scales:
            raise ConfigError("--kv-rotation hadamard rotates K and V, but static KV scales are calibrated on them "
                              "unrotated: use --kv-scales online with it, or --kv-rotation none.")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len {self.max_model_len} must be ≥ 2 tokens (or unset).")
        if not _is_dtype(self.dtype):
            raise ConfigError(f"--dtype {self.dtype!r} is not supported: choose auto, float16 or bfloat16.")

    @property
    def static_kv_scales(self) -> bool:
        """Whether the pool codes K and V with calibrated per-head scales (`kv_stats`): --kv-scales static on
        a quantized pool; a 16-bit pool has nothing to scale and ignores the setting."""
        return self.kv_scales == "static" and self.kv_bits != 16


def _is_dtype(value: Any) -> bool:
    if value is None or isinstance(value, str):
        return value is None or value in DTYPES
    import torch  # only where a caller passed a torch dtype

    return isinstance(value, torch.dtype) and value in (torch.float16, torch.bfloat16, torch.float32)


# The built-in value of each field that a model's generation_config.json may set instead.
SAMPLING_DEFAULTS = dict(max_tokens=256, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
# SamplingParams field ← GenerationConfig attribute.
FROM_GENERATION_CONFIG = dict(max_tokens="max_new_tokens", temperature="temperature", top_p="top_p", top_k="top_k",
                              min_p="min_p", repetition_penalty="repetition_penalty")


@dataclass
class SamplingParams:
    """One request's sampling settings. Fields left None take the model's generation_config.json values,
    then the built-in ones (`SAMPLING_DEFAULTS`): see `with_defaults`.

    temperature 0 is greedy. top_k 0 and top_p 1 are off. min_p drops tokens whose probability is below
    min_p × the most likely token's. repetition_penalty (HF's) divides positive / multiplies negative logits
    of every token of the prompt and the output; presence and frequency penalties (OpenAI's) subtract from
    the logits of tokens in the output once, or once per occurrence. `stop` strings end the generation and
    are not part of its text. `logprobs` k returns the chosen token's log-probability and the k most likely
    (0: the chosen only). `eos_token_ids` are the model's end tokens (the generation config's and the
    tokenizer's); they stop generation unless `ignore_eos`, while `stop_token_ids` always do. `min_tokens`
    (vLLM's): no end or stop token can be drawn before that many tokens are out (stop strings still apply;
    a request with a grammar ends where its grammar does). `structured` constrains the text to a grammar
    (engine/structured.py: a JSON schema, any JSON object, a regex, a choice, EBNF). `skip_special_tokens`
    False keeps special tokens in the text (tool-call markers such as InternLM2's <|action_start|>).
    """

    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    eos_token_ids: Optional[list[int]] = None
    min_tokens: int = 0
    structured: Optional[StructuredOutput] = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop or [] if s]
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]

    @property
    def is_resolved(self) -> bool:
        return all(getattr(self, name) is not None for name in SAMPLING_DEFAULTS) and self.eos_token_ids is not None

    def with_defaults(self, generation_config: Any = None, eos_token_id: Any = None) -> "SamplingParams":
        """A copy with every unset field filled: from `generation_config` (a transformers GenerationConfig,
        a dict of its fields, or None) where it sets the field, else the built-in default. `eos_token_ids`
        is the union of the config's eos_token_id (int or list) and `eos_token_id` (the tokenizer's), as
        vLLM stops: a chat model's config often names its end-of-turn token, its tokenizer the end of text.

        A config that says do_sample false makes the default greedy (temperature 0), as transformers'
        `generate` would decode that model.
        """
        gen = _as_dict(generation_config)
        filled: dict[str, Any] = {}
        for name, default in SAMPLING_DEFAULTS.items():
            if getattr(self, name) is not None:
                continue
            value = gen.get(FROM_GENERATION_CONFIG[name])
            if name == "temperature" and gen.get("do_sample") is False:
                value = 0.0
            filled[name] = default if value is None else type(default)(value)
        if self.eos_token_ids is None:
            ids = _token_ids(gen.get("eos_token_id")) + _token_ids(eos_token_id)
            filled["eos_token_ids"] = list(dict.fromkeys(ids))  # the config's first, each once
        out = dataclasses.replace(self, **filled)
        out.validate()
        return out

    def validate(self) -> None:
        """One-line errors for settings no sampler can honour."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"max_tokens {self.max_tokens} must be ≥ 1.")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ConfigError(f"min_tokens {self.min_tokens} must be in [0, max_tokens ({self.max_tokens})].")
        if self.temperature is not None and self.temperature < 0:
            raise ConfigError(f"temperature {self.temperature} must be ≥ 0 (0 is greedy).")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p {self.top_p} must be in (0, 1] (1 turns it off).")
        if self.top_k is not None and self.top_k < 0:
            raise ConfigError(f"top_k {self.top_k} must be ≥ 0 (0 turns it off).")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p {self.min_p} must be in [0, 1] (0 turns it off).")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty {self.repetition_penalty} must be > 0 (1 turns it off).")
        if self.logprobs is not None and self.logprobs < 0:
            raise ConfigError(f"logprobs {self.logprobs} must be ≥ 0 (0: the chosen token's only).")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ConfigError("structured must be a StructuredOutput (StructuredOutput.json_schema(...), "
                              ".regex(...), .choice([...]), .grammar(...), .json_object()).")


def _token_ids(value: Any) -> list[int]:
    """An eos_token_id setting (None, an int or a list of ints) as a list."""
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(t) for t in value]


def _as_dict(generation_config: Any) -> dict:
    if generation_config is None:
        return {}
    if isinstance(generation_config, dict):
        return generation_config
    return {k: v for k, v in vars(generation_config).items() if not k.startswith("_")}
