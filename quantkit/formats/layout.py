"""What every packed-weight format provides (`WeightFormat`), the layout it records (`WeightLayout`), and
the packing of small integers into int32 words that the formats share. A format turns quantkit's
integers (q [out, in], zeros [out, groups] in 0..2^b−1, scales [out, groups]: W = (q − z) · s) into
its checkpoint tensors and back; loaders and exporters reach it through `formats.registry`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class WeightLayout:
    """How a checkpoint's weights were quantized: `bits` per weight, `group_size` inputs per scale
    (-1: one group per output channel), `symmetric` (no zero points stored)."""

    bits: int
    group_size: int
    symmetric: bool


class WeightFormat:
    """One on-disk format of packed weights; `name` is its `quant_method` (and `--format`). Each provides:

    problem(qc) → why tensors under this quantization_config would be misread, or None;
    read_layout(qc) → WeightLayout; write_config(layout, ignore) → the config.json entry (`ignore`:
    modules left in full precision); pack(q, zeros, scales, layout) → one linear's tensors by name;
    unpack(tensors, layout) → (q, zeros, scales), undoing pack; join(parts, layout) → the tensors of one
    layer computing the outputs of `parts` (linears sharing an input) in order; linear_args(tensors,
    layout) → the QuantLinear arguments (features, bits, group size, kernel layout) that hold them."""

    name: str
    tensor_names: tuple[str, ...]
    fp16_activations = False  # whether its consumers expect fp16 activations (AWQ's)
    writes_kv_scales = False  # whether vLLM reads static KV scales beside its weights

    def holds(self, tensors: Tensors) -> bool:
        """Whether a linear's checkpoint tensors are this format's packed ones (not a full-precision weight)."""
        return self.tensor_names[0] in tensors


def pack_words(values: torch.Tensor, bits: int, order: Optional[Sequence[int]] = None) -> torch.Tensor:
    """[rows, n] ints in 0..2^b−1 → int32 [rows, ceil(n·b/32)], zero padded: value i of a word in bits
    b·i … b·i+b−1 holds column order[i] of its run of 32/b columns (in sequence without `order`)."""
    per_word = 32 // bits
    rows, n = values.shape
    words = -(-n // per_word)
    v = torch.zeros(rows, words * per_word, dtype=torch.int64, device=values.device)
    v[:, :n] = values.to(torch.int64)
    v = v.reshape(rows, words, per_word)
    if order is not None:
        v = v[:, :, list(order)]
    shifts = torch.arange(0, bits * per_word, bits, dtype=torch.int64, device=v.device)
    packed = (v << shifts).sum(dim=-1)
    # Words ≥ 2^31 wrap to negative int32, which is what the consumers read back.
    return (packed - (packed >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def unpack_words(packed: torch.Tensor, bits: int, n: int, order: Optional[Sequence[int]] = None) -> torch.Tensor:
    """int32 [rows, words] → int32 [rows, n], undoing `pack_words` with the same `order`."""
    per_word = 32 // bits
    shifts = torch.arange(0, bits * per_word, bits, dtype=torch.int32, device=packed.device)
    v = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)
    if order is not None:  # column j of a run sits in value order.index(j)
        v = v[:, :, [list(order).index(j) for j in range(per_word)]]
    return v.reshape(packed.shape[0], -1)[:, :n]
