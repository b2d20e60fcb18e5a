"""How far a model's next-token distributions are from a reference model's, token by token, as
llama.cpp's `perplexity --kl-divergence` reports it: the mean over predicted positions of
KL(P_ref ‖ P) = Σ_v p_ref(v) · (log p_ref(v) − log p(v)), in nats, and the share of positions whose most
likely token is the reference's ("same top"). Both models read the same token windows; the reference's
logits of a window are compared with the model's as soon as both exist, never stored beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Divergence:
    """Running sums over the positions seen so far."""

    kl_sum: float = 0.0
    same_top: int = 0
    positions: int = 0

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor, rows: int = 256) -> None:
        """Logits [N, vocab] of the same N positions, from the reference and from the model (taken `rows`
        positions at a time: a 2048-token window of a 128k vocabulary is 1 GiB of float32 per copy)."""
        for ref, own in zip(ref_logits.split(rows), logits.split(rows)):
            ref = ref.float().log_softmax(-1)
            own = own.float().to(ref.device).log_softmax(-1)
            self.kl_sum += float((ref.exp() * (ref - own)).sum())
            self.same_top += int((ref.argmax(-1) == own.argmax(-1)).sum())
            self.positions += ref.shape[0]

    @property
    def kl(self) -> float:
        """Mean KL divergence from the reference (nats per position)."""
        return self.kl_sum / self.positions

    @property
    def top1(self) -> float:
        """Share of positions whose argmax equals the reference's, in [0, 1]."""
        return self.same_top / self.positions
