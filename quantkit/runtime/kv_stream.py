"""One layer's K or V cache as a stream of tokens: append new states, read all of them back.

- `TokenStream`: codes written per token (online per-token or static scales, see kv_codec). New
  tokens are coded before they are read, so attention always sees quantized states.
- `ChannelGroupStream`: KIVI's layout for int4 keys — per channel, one scale and zero per group of
  `group` tokens, which follows the few outlier key channels instead of letting them set every
  token's step. A group is coded when it is complete; until then its tokens (fewer than `group`)
  stay in full precision, and `append` returns them unquantized.

Both hold tensors whose dim 0 is the batch, so reordering and batch selection are index ops.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from quantkit.runtime import kv_quant
from quantkit.runtime.kv_codec import Parts, StateCodec

Fn = Callable[[torch.Tensor], torch.Tensor]


def _nbytes(parts: Optional[Parts]) -> int:
    return 0 if parts is None else sum(t.numel() * t.element_size() for t in parts.values())


def _cat(old: Optional[Parts], new: Parts) -> Parts:
    return new if old is None else {k: torch.cat([old[k], new[k]], dim=-2) for k in new}


class TokenStream:
    """Per-token codes appended as they come."""

    def __init__(self, codec: StateCodec) -> None:
        self.codec, self.parts, self.length = codec, None, 0

    def to_device(self, device: torch.device) -> None:
        self.codec = self.codec.to(device)

    def append(self, x: torch.Tensor) -> torch.Tensor:
        self.parts = _cat(self.parts, self.codec.encode(x))
        self.length += x.shape[-2]
        return self.codec.decode(self.parts, x.dtype)

    def apply(self, fn: Fn) -> None:
        if self.parts is not None:
            self.parts = {k: fn(v) for k, v in self.parts.items()}

    def crop(self, keep: int) -> None:
        self.apply(lambda t: t[..., :keep, :])
        self.length = min(self.length, keep)

    def nbytes(self) -> int:
        return _nbytes(self.parts) + self.codec.constant_nbytes()


class ChannelGroupStream:
    """Per-channel codes over complete groups of `group` tokens, plus the incomplete group in full precision."""

    def __init__(self, bits: int, group: int) -> None:
        self.bits, self.group = bits, group
        self.parts: Optional[Parts] = None  # q [B,H,n·group,D(/2)], scale/zero [B,H,n,D]
        self.residual: Optional[torch.Tensor] = None
        self.length = 0

    def to_device(self, device: torch.device) -> None:
        pass

    def _decode(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        if self.parts is None:
            return None
        q = kv_quant.unpack(self.parts["q"], self.bits)
        b, h, t, d = q.shape
        q = q.reshape(b, h, t // self.group, self.group, d)
        scale, zero = self.parts["scale"].unsqueeze(-2), self.parts["zero"].unsqueeze(-2)
        return kv_quant.decode(q, scale, zero, dtype).reshape(b, h, t, d)

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Return every token (coded groups decoded, the rest as given), then code the groups now complete."""
        pending = x if self.residual is None else torch.cat([self.residual, x], dim=-2)
        done = self._decode(x.dtype)
        out = pending if done is None else torch.cat([done, pending], dim=-2)
        self.length += x.shape[-2]
        n = pending.shape[-2] // self.group * self.group
        if n:
            b, h, _, d = pending.shape
            g = pending[..., :n, :].float().reshape(b, h, n // self.group, self.group, d)
            scale, zero = kv_quant.range_params(g.amin(-2, keepdim=True), g.amax(-2, keepdim=True), self.bits)
            q = kv_quant.encode(g, scale, zero, self.bits).reshape(b, h, n, d)
            new = {"q": kv_quant.pack(q, self.bits), "scale": scale.squeeze(-2).half(),
                   "zero": zero.squeeze(-2).to(torch.uint8)}
            self.parts = _cat(self.parts, new)
        self.residual = pending[..., n:, :]
        return out

    def apply(self, fn: Fn) -> None:
        if self.parts is not None:
            self.parts = {k: fn(v) for k, v in self.parts.items()}
        if self.residual is not None:
            self.residual = fn(self.residual)

    def crop(self, keep: int) -> None:
        """Keep the first `keep` tokens; a group cut in two goes back to full precision (decoded)."""
        if keep >= self.length or self.residual is None:
            return
        coded = 0 if self.parts is None else self.parts["q"].shape[-2]
        if keep >= coded:
            self.residual = self.residual[..., : keep - coded, :]
        else:
            whole = keep // self.group
            decoded = self._decode(self.residual.dtype)
            self.residual = decoded[..., whole * self.group: keep, :]
            self.parts = {"q": self.parts["q"][..., : whole * self.group, :],
                          "scale": self.parts["scale"][..., :whole, :], "zero": self.parts["zero"][..., :whole, :]}
            if whole == 0:
                self.parts = None
        self.length = keep

    def nbytes(self) -> int:
        res = 0 if self.residual is None else self.residual.numel() * self.residual.element_size()
        return _nbytes(self.parts) + res
