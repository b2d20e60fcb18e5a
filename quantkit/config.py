"""Frozen dataclasses for every quantization scheme, and the YAML recipes that fill them.

A recipe is a YAML mapping whose keys are the fields of `QuantizeConfig` (nested mappings for
`weight`, `calib`, `awq`, `learn`, `fp8`). CLI flags override what a recipe says; a flag left unset keeps
the recipe's value, and a field neither sets keeps the dataclass default.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

METHODS = ("rtn", "int8", "awq", "fp8")
FORMATS = ("awq", "compressed-tensors")
# The format `fp8` writes (compressed-tensors "float-quantized", formats/fp8.py); no other method writes it.
FP8_FORMAT = "float-quantized"
FP8_SCHEMES = ("dynamic", "static")
FP8_WEIGHT_STRATEGIES = ("channel", "tensor")
FP8_ROUNDINGS = ("nearest", "gptq")
GROUP_SIZES_DOC = "32, 64, 128 or -1 (one group per output channel)"
# What each on-disk format can hold; the --w-bits help and its refusal say the same.
WRITABLE_BITS_DOC = "4 (awq or compressed-tensors) or 8 (compressed-tensors)"
ROUNDINGS = ("nearest", "gptq", "learned")
MAX_LEARN_STEPS = 10000
# KV cache bits: 16 keeps K and V in the model's dtype, 8 and 4 store integer codes (kernels/paged_kv.py).
KV_BITS = (16, 8, 4)


class UserError(ValueError):
    """A problem the user can fix (bad path, setting or data); the CLI prints it as one line, exit 2."""


class ConfigError(UserError):
    """A setting a user chose is invalid; the message says which and how to fix it."""


def read_json(path: Path, error: type[UserError] = UserError) -> dict[str, Any]:
    """A JSON file of a checkpoint or the user's: {} where it is missing, `error` in one line where malformed."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None


def read_json_schema(path: Union[str, Path]) -> dict[str, Any]:
    """A JSON schema from a file (structured output: `generate --json-schema`, `api-client --json-schema`); a
    UserError naming the file when it cannot be read or holds no object."""
    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read the JSON schema {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise UserError(f"{path} is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise UserError(f"{path} holds a JSON {type(schema).__name__}, not a schema (an object)")
    return schema


@dataclass(frozen=True)
class WeightQuantConfig:
    """Integer weight quantization: `bits` per weight, one scale (and zero) per `group_size` inputs."""

    bits: int = 4
    group_size: int = 128
    symmetric: bool = False

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ConfigError(f"--w-bits {self.bits} is not supported: choose 2 to 8.")
        if self.group_size != -1 and self.group_size < 8:
            raise ConfigError(f"--group-size {self.group_size} is not supported: use {GROUP_SIZES_DOC}.")

    def effective_group_size(self, in_features: int) -> int:
        """Inputs per group for a layer of `in_features` inputs (group size -1: all of them)."""
        return in_features if self.group_size == -1 else self.group_size


@dataclass(frozen=True)
class CalibConfig:
    """Which text calibrates the model and how much of it."""

    dataset: str = "ptb"
    samples: int = 128
    seqlen: int = 512
    seed: int = 0
    data_dir: Optional[str] = None
    batch_size: int = 8

    def __post_init__(self) -> None:
        if self.samples < 1 or self.seqlen < 2:
            raise ConfigError("--calib-samples must be ≥ 1 and --calib-seqlen ≥ 2.")
        if self.batch_size < 1:
            raise ConfigError("--batch-size must be ≥ 1.")


@dataclass(frozen=True)
class AWQConfig:
    """Settings of the activation-aware scale and clip search."""

    n_grid: int = 20
    # True/False, or "both": search the ratio grid with and without the weight statistic.
    duo_scaling: Union[bool, str] = True
    max_shrink: float = 0.5
    clip: bool = True
    search_tokens: int = 4096
    clip_tokens: int = 512
    # Clip min and max apart (asymmetric quantization only); False shrinks both ends together.
    asym_clip: bool = True
    # Scale v→o under grouped-query attention too (one scale per v row, shared by its query heads).
    gqa_scaling: bool = True
    # Inputs of each block: "quantized" (outputs of the already-quantized blocks) or "fp" (reference tools).
    propagate: str = "quantized"
    # On the CPU, run the blocks in fp32 with bf16 matrix products (AMX units make them ~10x faster).
    cpu_bf16: bool = True
    # Integer codes under AWQ's scales/zeros: "nearest" (the reference tools), "gptq" (error feedback
    # through the inputs' Gram matrix, Frantar et al. 2022) or "learned" (gptq's codes, then rounding
    # offsets and clip ranges learned per block: `LearnConfig`); the same checkpoint layout for all.
    # RTN reads it too: "learned" there starts from the nearest codes (and needs calibration text).
    rounding: str = "gptq"

    def __post_init__(self) -> None:
        if self.n_grid < 1:
            raise ConfigError("--n-grid must be ≥ 1.")
        if not 0 < self.max_shrink <= 1:
            raise ConfigError(f"--max-shrink {self.max_shrink} is out of range: choose a value in (0, 1].")
        if self.duo_scaling not in (True, False, "both"):
            raise ConfigError(f"duo_scaling {self.duo_scaling!r} is not supported: choose true, false or both.")
        if self.propagate not in ("quantized", "fp"):
            raise ConfigError(f"propagate {self.propagate!r} is not supported: choose quantized or fp.")
        if self.rounding not in ROUNDINGS:
            raise ConfigError(f"rounding {self.rounding!r} is not supported: choose learned, nearest or gptq.")
        if self.search_tokens < 1:
            raise ConfigError("search_tokens must be ≥ 1.")


@dataclass(frozen=True)
class LearnConfig:
    """`rounding: learned`: per block, sign-gradient steps on rounding offsets and clip ranges (quantize/learned.py)."""

    steps: int = 200
    lr: float = 5e-3  # decays linearly to 0 over the steps
    batch: int = 1  # calibration windows per step
    seed: int = 0  # order of the windows

    def __post_init__(self) -> None:
        if not 1 <= self.steps <= MAX_LEARN_STEPS:
            raise ConfigError(f"--learn-steps {self.steps} is out of range: choose 1 to {MAX_LEARN_STEPS} (default: 200).")
        if not 0 < self.lr <= 0.5:
            raise ConfigError(f"--learn-lr {self.lr} is out of range: choose a value in (0, 0.5] (default: 0.005).")
        if self.batch < 1:
            raise ConfigError(f"learn.batch {self.batch} is out of range: choose 1 or more windows per step.")


@dataclass(frozen=True)
class Fp8Config:
    """FP8 (e4m3) weights and activations: `scheme` "dynamic" quantizes the activations per token at run
    time (no calibration data), "static" per tensor with scales measured on calibration text;
    `weight_strategy` is one weight scale per output channel or per tensor; `rounding` puts the weights onto the
    e4m3 grid by "nearest" (llm-compressor's; no data) or "gptq" (error feedback through the inputs' Gram
    matrices on calibration text, the scales unchanged). Left unset it is gptq for the static scheme, which
    reads calibration text anyway, and nearest for the dynamic one, which then needs no data."""

    scheme: str = "dynamic"
    weight_strategy: str = "channel"
    rounding: Optional[str] = None

    def __post_init__(self) -> None:
        if self.scheme not in FP8_SCHEMES:
            raise ConfigError(f"--scheme {self.scheme!r} is not supported: choose dynamic or static.")
        if self.weight_strategy not in FP8_WEIGHT_STRATEGIES:
            raise ConfigError(f"--weight-strategy {self.weight_strategy!r} is not supported: choose channel or tensor.")
        if self.rounding is None:
            object.__setattr__(self, "rounding", "gptq" if self.scheme == "static" else "nearest")
        if self.rounding not in FP8_ROUNDINGS:
            raise ConfigError(f"--rounding {self.rounding!r} is not supported for fp8: choose nearest or gptq.")


@dataclass(frozen=True)
class QuantizeConfig:
    """Everything a quantization run needs besides the model and the output directory."""

    method: str = "rtn"
    weight: WeightQuantConfig = field(default_factory=WeightQuantConfig)
    format: Optional[str] = None
    calib: CalibConfig = field(default_factory=CalibConfig)
    awq: AWQConfig = field(default_factory=AWQConfig)
    learn: LearnConfig = field(default_factory=LearnConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    device: Optional[str] = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method {self.method!r} is unknown: choose one of {', '.join(METHODS)}.")
        if self.method == "fp8" or self.format == FP8_FORMAT:
            if self.method != "fp8" or self.format not in (None, FP8_FORMAT):
                raise ConfigError(f"--format {self.format} with method {self.method} cannot be written: FP8 is "
                                  f"written as {FP8_FORMAT} (`quantkit fp8`), integers as awq or compressed-tensors.")
            if (self.weight.bits, self.weight.group_size, self.weight.symmetric) != (8, -1, True):
                raise ConfigError("fp8 takes no integer weight settings (bits, group size, symmetric): its weights are "
                                  "e4m3 with one scale per channel or tensor (fp8.weight_strategy).")
            check_device(self.device)
            return
        fmt = self.resolved_format
        if fmt not in FORMATS:
            raise ConfigError(f"--format {fmt!r} is unknown: choose awq or compressed-tensors.")
        if fmt == "awq" and self.weight.bits != 4:
            raise ConfigError(
                f"--w-bits {self.weight.bits} cannot be written as --format awq (AWQ gemm is 4-bit only): "
                "use --w-bits 4 or --format compressed-tensors."
            )
        if fmt == "compressed-tensors" and self.weight.bits not in (4, 8):
            raise ConfigError(
                f"--w-bits {self.weight.bits} cannot be written: checkpoints hold {WRITABLE_BITS_DOC} bits; "
                "use --w-bits 4 or 8."
            )
        check_device(self.device)

    @property
    def calibrated(self) -> bool:
        """Whether the run needs calibration text: AWQ, RTN with learned rounding, FP8 static or with GPTQ rounding."""
        return (self.method == "awq" or (self.method == "rtn" and self.awq.rounding == "learned")
                or (self.method == "fp8" and (self.fp8.scheme == "static" or self.fp8.rounding == "gptq")))

    @property
    def resolved_format(self) -> str:
        """The on-disk format: the one asked for, else float-quantized for FP8, AWQ gemm for 4-bit and
        compressed-tensors otherwise."""
        if self.method == "fp8":
            return FP8_FORMAT
        if self.format:
            return self.format
        return "awq" if self.weight.bits == 4 else "compressed-tensors"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_kv_bits(bits: int) -> None:
    """Refuse a KV cache width the pool cannot store."""
    if bits not in KV_BITS:
        raise ConfigError(f"--kv-bits {bits} is not supported: choose 16 (the model's dtype), 8 or 4.")


def check_device(name: Optional[str]) -> None:
    """Refuse a device this machine does not have (`--device cuda` without CUDA), before any work.
    None means the default (CUDA when present, else the CPU), which is always there."""
    if name is None:
        return
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device: use cpu, cuda or cuda:N.") from None
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None and torch.version.hip is None \
            else "no GPU is visible"
        raise ConfigError(f"--device {name}: this machine has no CUDA GPU ({why}); use --device cpu.")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(f"--device {name}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}.")


# What a method implies unless the recipe or a flag says otherwise: int8 is weight-only W8 with one symmetric
# scale per output channel (what vLLM's W8A16 kernels take); fp8's weights are 8-bit, symmetric, at least per
# channel (what its report and the evaluation tables read; Fp8Config says channel or tensor).
_W8_CHANNEL = {"weight": {"bits": 8, "group_size": -1, "symmetric": True}}
METHOD_DEFAULTS = {"int8": _W8_CHANNEL, "fp8": _W8_CHANNEL}
_NESTED = {"weight": WeightQuantConfig, "calib": CalibConfig, "awq": AWQConfig, "learn": LearnConfig,
           "fp8": Fp8Config}


def load_recipe(path: str | Path) -> dict[str, Any]:
    """Read a YAML recipe into a plain mapping (validated when it is turned into a config)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"recipe {p} does not exist: pass a YAML file such as recipes/w4g128-rtn.yaml.")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {p} is not valid YAML: {exc}".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {p} must be a mapping of settings, not {type(data).__name__}.")
    return data


def build_config(recipe: Optional[dict[str, Any]] = None, **overrides: Any) -> QuantizeConfig:
    """Merge a recipe with overrides; None means 'not set'. A section's overrides come as a mapping of its
    fields (``weight={"bits": 4}``) or as dotted keys (``weight.bits``). The method's own defaults
    (`METHOD_DEFAULTS`) lie beneath both."""
    merged: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in (recipe or {}).items()}
    for key, value in overrides.items():
        if "." in key:
            key, inner = key.split(".", 1)
            value = {inner: value}
        if isinstance(value, dict):
            merged[key] = {**(merged.get(key) or {}), **{k: v for k, v in value.items() if v is not None}}
        elif value is not None:
            merged[key] = value
    for section, defaults in METHOD_DEFAULTS.get(merged.get("method"), {}).items():
        merged[section] = {**defaults, **(merged.get(section) or {})}
    known = {f.name for f in dataclasses.fields(QuantizeConfig)}
    unknown = set(merged) - known
    if unknown:
        raise ConfigError(f"unknown recipe keys {sorted(unknown)}: allowed are {sorted(known)}.")
    kwargs: dict[str, Any] = {}
    for key, value in merged.items():
        if key in _NESTED:
            cls = _NESTED[key]
            allowed = {f.name for f in dataclasses.fields(cls)}
            bad = set(value) - allowed
            if bad:
                raise ConfigError(f"unknown keys {sorted(bad)} under {key!r}: allowed are {sorted(allowed)}.")
            kwargs[key] = cls(**value)
        else:
            kwargs[key] = value
    return QuantizeConfig(**kwargs)
