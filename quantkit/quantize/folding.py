"""Folding AWQ scales into the model: prev's outputs ÷ s, the group's input columns × s.

The product W·x is unchanged in exact arithmetic, so the fp model computes the same function
(tests check the logits). `prev` is a norm (weight, optional bias, one entry per channel) or a
linear (only its output rows are touched, so its own quantization groups along the input stay).

Under grouped-query attention, v_proj has kv_heads·head_dim outputs while o_proj has heads·head_dim
inputs: o's input channel (h, d) is v's row (h // g, d) with g = heads / kv_heads. One scale per v
row is then shared by the g o-columns it feeds (`HeadTying`); the reference tools skip v→o there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class HeadTying:
    """Maps scales over prev's `n` outputs to `n·repeat` input columns, head_dim rows per head."""

    kv_heads: int
    repeat: int
    head_dim: int

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        """[kv·hd] → [kv·g·hd]: each v row's scale for each query head reading it."""
        v = s.reshape(self.kv_heads, 1, self.head_dim).expand(self.kv_heads, self.repeat, self.head_dim)
        return v.reshape(-1)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """[kv·g·hd] → [kv·hd]: the mean over the query heads sharing a v row."""
        return x.reshape(self.kv_heads, self.repeat, self.head_dim).mean(1).reshape(-1)


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def output_channels(prev: torch.nn.Module) -> int:
    """How many channels `prev` produces (a linear's rows, a norm's weight entries)."""
    if isinstance(prev, torch.nn.Linear):
        return prev.out_features
    weight = getattr(prev, "weight", None)
    if weight is None or weight.ndim != 1:
        raise ValueError(f"cannot fold scales into {type(prev).__name__}: it has no per-channel weight")
    return weight.shape[0]


def head_tying(model_config, prev_out: int, in_features: int) -> Optional[HeadTying]:
    """The tying for a v→o pair whose shapes differ by the GQA factor, or None when it isn't one."""
    heads = getattr(model_config, "num_attention_heads", None)
    kv = getattr(model_config, "num_key_value_heads", None) or heads
    if not heads or not kv or heads % kv:
        return None
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    if prev_out != kv * head_dim or in_features != heads * head_dim:
        return None
    return HeadTying(kv, heads // kv, head_dim)


@torch.no_grad()
def fold_scales(prev: torch.nn.Module, linears: list[torch.nn.Linear], s: torch.Tensor, columns: torch.Tensor,
                rows: Optional[slice] = None) -> None:
    """prev's outputs (those in `rows` when given) ÷ `s`; each linear's input columns × `columns` (= s
    expanded to them)."""
    s = s.to(prev.weight.device)
    part = (lambda t: t) if rows is None else (lambda t: t[rows])  # a view: dividing it divides prev
    if isinstance(prev, torch.nn.Linear):
        part(prev.weight).div_(s.to(prev.weight.dtype).unsqueeze(1))
    else:
        part(prev.weight).div_(s.to(prev.weight.dtype))
    bias = getattr(prev, "bias", None)
    if isinstance(bias, torch.Tensor):
        part(bias).div_(s.to(bias.dtype))
    for lin in linears:
        lin.weight.mul_(columns.to(device=lin.weight.device, dtype=lin.weight.dtype))
