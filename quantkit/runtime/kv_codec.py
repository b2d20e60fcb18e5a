"""How K or V states become integer codes per token and back: online, or with static scales.

- online: one fp16 scale and uint8 zero per token per head, computed from the row itself (lmdeploy's
  quant_policy 8/4).
- static: scale and zero fixed per head (or per head and channel) from the calibration ranges; nothing
  is stored per token, and values outside the calibrated range are clipped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from quantkit.runtime import kv_quant

Parts = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StateCodec:
    """Encodes states [batch, heads, tokens, head_dim] to a dict of tensors whose dim −2 is tokens."""

    bits: int
    # Static: scale and zero broadcastable to [1, heads, 1, head_dim or 1]. None means online.
    scale: Optional[torch.Tensor] = None
    zero: Optional[torch.Tensor] = None

    @property
    def online(self) -> bool:
        return self.scale is None

    def to(self, device: torch.device) -> "StateCodec":
        move = {k: getattr(self, k).to(device) for k in ("scale", "zero") if getattr(self, k) is not None}
        return replace(self, **move)

    def encode(self, x: torch.Tensor) -> Parts:
        if not self.online:
            return {"q": kv_quant.pack(kv_quant.encode(x, self.scale, self.zero, self.bits), self.bits)}
        q, scale, zero = kv_quant.quantize_per_token(x, self.bits)
        return {"q": kv_quant.pack(q, self.bits), "scale": scale, "zero": zero}

    def decode(self, parts: Parts, dtype: torch.dtype) -> torch.Tensor:
        q = kv_quant.unpack(parts["q"], self.bits)
        if not self.online:
            return kv_quant.decode(q, self.scale, self.zero, dtype)
        return kv_quant.decode(q, parts["scale"], parts["zero"], dtype)

    def constant_nbytes(self) -> int:
        """Bytes of the per-layer constants (static scales and zeros), counted as cache memory."""
        return sum(t.numel() * t.element_size() for t in (self.scale, self.zero) if t is not None)


def _heads(t: torch.Tensor) -> torch.Tensor:
    """[heads, head_dim] → the broadcast shape [1, heads, 1, head_dim]."""
    return t.float()[None, :, None, :]


def static_codec(mn: torch.Tensor, mx: torch.Tensor, bits: int, per_channel: bool) -> StateCodec:
    """A static codec from one layer's [heads, head_dim] ranges: one scale per head, or per head and channel."""
    if not per_channel:
        mn, mx = mn.amin(-1, keepdim=True), mx.amax(-1, keepdim=True)
    scale, zero = kv_quant.range_params(_heads(mn), _heads(mx), bits)
    return StateCodec(bits, scale=scale, zero=zero)
