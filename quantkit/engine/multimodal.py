"""Image features in a request: where they go in the prompt, and which of them a step's tokens take.

A multimodal prompt is token ids in which each image is a run of placeholder tokens (the processor
expands one `<image>` into as many as the image has features), plus the features themselves. The
engine computes the prompt like any other — in chunks, after a prefix-cache hit, again after a
preemption — and each step's rows at placeholder positions take their feature rows instead of the
placeholder's embedding (`step_embeds`). The images' hash starts the request's prefix-cache hash
chain, so blocks are shared only between requests with the same images before them.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from typing import Iterable, Optional

import torch


@dataclass
class ImageInputs:
    """The embeddings [P, hidden] that replace the prompt's image placeholder tokens, at `positions`
    (ascending prompt positions, one per row), and `hash`, the SHA-256 digest of the images' pixels
    (`pixel_hash`): the start of the request's prefix-cache key chain."""

    positions: list[int]
    embeds: torch.Tensor
    hash: bytes

    def __post_init__(self) -> None:
        if len(self.positions) != self.embeds.shape[0]:
            raise ValueError(f"{len(self.positions)} image positions for {self.embeds.shape[0]} feature rows")

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The rows [lo, hi) of the positions in [start, end)."""
        return bisect.bisect_left(self.positions, start), bisect.bisect_left(self.positions, end)


@dataclass
class MultiModalPrompt:
    """A prompt ready for the engine: its token ids (placeholders expanded) and its images' embeddings."""

    token_ids: list[int]
    images: Optional[ImageInputs] = None

    def __len__(self) -> int:  # counts as its token ids where a prompt's length is asked
        return len(self.token_ids)


def pixel_hash(tensors: Iterable[torch.Tensor]) -> bytes:
    """The SHA-256 digest (32 bytes) of the tensors' shapes, dtypes and bytes: the prefix cache's chain
    start for a request's images, so blocks after different images never share a key."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def step_embeds(batch, device: torch.device) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """For a scheduled batch of (sequence, new token count): the flat rows of the step's image tokens and
    their embeddings, or None when none of its tokens is an image's."""
    rows: list[int] = []
    values: list[torch.Tensor] = []
    offset = 0
    for seq, n in batch:
        images = getattr(seq, "images", None)
        if images is not None:
            start = seq.num_computed_tokens
            lo, hi = images.span(start, start + n)
            if hi > lo:
                rows.extend(offset + p - start for p in images.positions[lo:hi])
                values.append(images.embeds[lo:hi])
        offset += n
    if not rows:
        return None
    return torch.tensor(rows, dtype=torch.long, device=device), torch.cat(values).to(device)
