"""What every packed-weight format provides (`WeightFormat`) and the layout it records (`WeightLayout`)
(the packing of small integers into int32 words is quantkit.packing's, shared with the kernels). A format turns quantkit's
integers (q [out, in], zeros [out, groups] in 0..2^b−1, scales [out, groups]: W = (q − z) · s) into
its checkpoint tensors and back; loaders and exporters reach it through `formats.registry`."""

from __future__ import annotations

from dataclasses import dataclass

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
