"""What every packed-weight format provides (`WeightFormat`) and the layout it records (`WeightLayout`)
(the packing of small integers into int32 words is quantkit.packing's, shared with the kernels). A format turns quantkit's
integers (q [out, in], zeros [out, groups] in 0..2^b−1, scales [out, groups]: W = (q − z) · s) into
its checkpoint tensors and back; loaders and exporters reach it through `formats.registry`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quantkit.config import QuantizeConfig

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class WeightLayout:
    """How a checkpoint's weights were quantized: `bits` per weight, `group_size` inputs per scale
    (-1: one group per output channel), `symmetric` (no zero points stored)."""

    bits: int
    group_size: int
    symmetric: bool

    @property
    def scale_group(self) -> int:
        """Inputs per weight scale, as reports show it: the group size, -1 one per output channel, 0 one per
        tensor."""
        return self.group_size


class WeightFormat:
    """One on-disk format of packed weights; `name` is its registry key (and `--format`), `quant_method`
    what config.json says (the name unless formats share one: `claims` then tells them apart). Each provides:

    problem(qc) → why tensors under this quantization_config would be misread, or None;
    read_layout(qc) → WeightLayout; layout_of(config) → the WeightLayout a QuantizeConfig writes;
    write_config(layout, ignore) → the config.json entry (`ignore`: modules left in full precision);
    pack(q, zeros, scales, layout, input_scale) → one linear's tensors by name (`input_scale`: the static
    activation scale of a format that stores one, else None); unpack(tensors, layout) → (q, zeros,
    scales), undoing pack; join(parts, layout) → the tensors of one layer computing the outputs of
    `parts` (linears sharing an input) in order; linear_args(tensors, layout) → the arguments (features,
    bits, group size, kernel layout) of the module that holds them."""

    name: str
    tensor_names: tuple[str, ...]
    fp16_activations = False  # whether its consumers expect fp16 activations (AWQ's)
    writes_kv_scales = False  # whether vLLM reads static KV scales beside its weights

    @property
    def quant_method(self) -> str:
        return self.name

    @property
    def marker(self) -> str:
        """The tensor that only this format's quantized linears have."""
        return self.tensor_names[0]

    def claims(self, qc: dict[str, Any]) -> bool:
        """Whether a quantization_config of this format's quant_method is this format's."""
        return True

    def layout_of(self, config: QuantizeConfig) -> WeightLayout:
        return WeightLayout(config.weight.bits, config.weight.group_size, config.weight.symmetric)

    def holds(self, tensors: Tensors) -> bool:
        """Whether a linear's checkpoint tensors are this format's packed ones (not a full-precision weight)."""
        return self.marker in tensors
