"""The decoder's small layers: RMSNorm, rotary embedding (with the config's scaling) and SiLU·mul.

The rotary embedding keeps one table `cos_sin` [positions, rotary_dim] (the cos and sin halves side
by side, transformers' `attention_scaling` folded in) that a position indexes, so the decode step
reads rows of a fixed tensor (CUDA-graph safe). Dynamic NTK scaling depends on how long the sequence
is, not only on the position, so its rows are computed per token, once per forward, from the length
of the token's sequence at this step — what transformers does when it runs one sequence at a time
(its keys are cached rotated, as here).

A config with `logn_attention_length` L (Qwen v1's logn attention, set by models/qwen.py) also has the
queries at positions p ≥ L multiplied by log_L(p + 1) after the rotation, a factor of the position alone.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from quantkit.config import UserError
from quantkit.kernels import fused
from quantkit.kernels.fp8 import Fp8Activations
from quantkit.kernels.settings import AUTO, KernelSettings
from quantkit.nn.fp8_linear import Fp8Linear

# RoPE variants whose frequencies depend on the position only (one table serves every sequence).
_TABLE_TYPES = ("default", "linear", "llama3", "yarn")


def use_kernels(model: nn.Module, kernels: KernelSettings) -> None:
    """Hand `kernels` to every module of `model` that launches kernels (those with a `kernels` attribute:
    the norms, activations and rotary here, and each QuantLinear)."""
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels


def feeds_fp8(producer: nn.Module, consumer: nn.Module) -> None:
    """Let `producer` (an RMSNorm or SiluAndMul) hand `consumer` its output quantized for it, in one fused
    op, when `consumer` is an FP8 linear (its activations per token, or under its static input_scale)."""
    # A plain attribute, not a submodule: the consumer stays where it is in the module tree.
    object.__setattr__(producer, "fp8_input_of", consumer if isinstance(consumer, Fp8Linear) else None)


def _as_fp8(out, dtype: torch.dtype):
    """(q, scale) of a quantizing fused op → Fp8Activations; with a residual, ((q, scale), h)."""
    if isinstance(out[0], tuple):
        return Fp8Activations(*out[0], dtype), out[1]
    return Fp8Activations(*out, dtype)


class RMSNorm(nn.Module):
    """y = x / rms(x) · w (fp32 inside); with `residual`, adds it first and returns (y, x + residual).
    Linked to an FP8 linear (feeds_fp8), y comes as its Fp8Activations."""

    kernels: KernelSettings = AUTO
    fp8_input_of: Optional[Fp8Linear] = None

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        into = self.fp8_input_of
        if into is None:
            return fused.rms_norm(x, self.weight, self.eps, residual, self.kernels)
        return _as_fp8(fused.rms_norm(x, self.weight, self.eps, residual, self.kernels, True, into.input_scale),
                       x.dtype)


class SiluAndMul(nn.Module):
    """silu(gate) · up; linked to an FP8 linear (feeds_fp8), as its Fp8Activations."""

    kernels: KernelSettings = AUTO
    fp8_input_of: Optional[Fp8Linear] = None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor | Fp8Activations:
        into = self.fp8_input_of
        if into is None:
            return fused.silu_mul(gate_up, self.kernels)
        return _as_fp8(fused.silu_mul(gate_up, self.kernels, True, into.input_scale), gate_up.dtype)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's rope parameters in transformers' standard form (rope_type, rope_theta, factor, …)."""
    config.standardize_rope_params()
    params = dict(config.rope_parameters or {})
    params.setdefault("rope_type", "default")
    return params


def inverse_frequencies(config: Any) -> tuple[torch.Tensor, float, int]:
    """inv_freq [rotary_dim/2], attention scaling, rotary_dim — from transformers' own rope functions,
    so every scaling variant means what it means there (dynamic: at the original context length)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_parameters(config)
    rope_type = params["rope_type"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        return inv_freq, 1.0, rotary_dim
    if rope_type not in _TABLE_TYPES + ("dynamic",):
        raise UserError(f"rope type {rope_type!r} is not supported by the engine; supported: "
                        f"{', '.join(_TABLE_TYPES + ('dynamic',))} (use quantkit.load for this model)")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling), rotary_dim


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    freqs = positions.float()[:, None] * inv_freq
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotates q and k in place on their first `rotary_dim` channels: channel pairs (i, i + rotary_dim/2)
    (transformers' rotate_half layout) or, `interleaved`, adjacent pairs (2i, 2i + 1) (Glm, ChatGLM).

    `rows(positions, seq_lens)` gives, once per forward, the table and the row of each token (and, with
    logn attention, each token's query factor) that every layer's `forward` then reads."""

    kernels: KernelSettings = AUTO

    def __init__(self, config: Any, max_positions: int, interleaved: bool = False) -> None:
        super().__init__()
        self.interleaved = interleaved
        params = rope_parameters(config)
        self.dynamic = params["rope_type"] == "dynamic"
        inv_freq, scaling, self.rotary_dim = inverse_frequencies(config)
        self.register_buffer("cos_sin", _cos_sin(torch.arange(max_positions), inv_freq, scaling), persistent=False)
        if self.dynamic:
            # transformers' dynamic NTK formula (_compute_dynamic_ntk_parameters), written with tensor ops
            # only so that a decode step stays capturable in a CUDA graph.
            self.base, self.factor = float(params["rope_theta"]), float(params["factor"])
            self.original_max = config.max_position_embeddings
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim
            self.register_buffer("exponents", exponents, persistent=False)
        self.logn_length = getattr(config, "logn_attention_length", None)

    def rows(self, positions: torch.Tensor, seq_lens: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """(cos_sin table, row index [T]), + the query factor [T] with logn attention; `seq_lens` [T] (the
        length of each token's sequence at this step) is read by dynamic scaling only."""
        rows = self._table_rows(positions, seq_lens)
        if self.logn_length:
            p = positions.to(torch.float) + 1
            factor = torch.where(p > self.logn_length, torch.log(p) / math.log(self.logn_length), torch.ones_like(p))
            rows = (*rows, factor)
        return rows

    def _table_rows(self, positions: torch.Tensor, seq_lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.dynamic:
            return self.cos_sin, positions
        if seq_lens is None:
            raise ValueError("dynamic rope scaling needs each token's sequence length")
        length = seq_lens.to(torch.float).clamp_min(self.original_max)
        dim = self.rotary_dim
        base = self.base * (self.factor * length / self.original_max - (self.factor - 1)) ** (dim / (dim - 2))
        inv_freq = 1.0 / base[:, None] ** self.exponents
        freqs = positions.float()[:, None] * inv_freq
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        return table, torch.arange(positions.shape[0], device=positions.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, rows: tuple[torch.Tensor, ...]) -> None:
        """q [T, heads, D], k [T, kv_heads, D]; `rows` from `rows()`."""
        table, index = rows[0], rows[1]
        fused.apply_rope_(q, k, index, table, self.rotary_dim, self.interleaved, self.kernels)
        if len(rows) > 2:
            q.mul_(rows[2].to(q.dtype)[:, None, None])
