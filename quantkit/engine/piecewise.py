"""CUDA graphs for prefill and mixed steps, in pieces around attention (vLLM's piecewise graphs).

A pure decode step replays one CUDA graph per batch-size bucket (model_runner). A step with prompt
tokens cannot: its attention takes each sequence's host lengths (how many queries, how long a cached
prefix), which a graph would freeze. Run eagerly, though, such a step pays one Python call per kernel —
for a 7B model tens of milliseconds of host time per step, more than the GPU needs for a 512-token
prompt — and meets kernels compiled on first sight at every new token count.

So for token counts up to `max_tokens`, the step is padded to the bucket above it and run as
layers + 1 graphs captured per bucket at start: the embedding and layer 0's `begin`; then for each
layer its `end` and the next layer's `begin`; the last `end` and the final norm. Attention (the KV
write, decode and prefill kernels, with the step's own metadata) runs eagerly between them, reading
q/k/v from and writing its output to static buffers the graphs share. Padding rows have token 0,
position 0 and slot −1: their K/V are written nowhere, attention never reads them, and every op in
the graphs is row-wise, so the real rows are the eager forward's.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from quantkit.engine.attention import AttnMetadata

log = logging.getLogger(__name__)

# Padded token counts. Between 512 and 2048 every 256: a step pads by less than a quarter above 512 and
# by at most 255 tokens (the padding is GPU work: ≈ 12 % at 2048).
BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048)
# Up to here by default: above 2048 tokens the GPU's time per step (tens of milliseconds for a 7B model)
# hides the eager launches.
MAX_TOKENS = 2048

Capture = Callable[[Callable[[], None]], Callable[[], None]]


def buckets_up_to(max_tokens: int) -> list[int]:
    """The buckets a runner taking steps of up to max_tokens tokens captures (the first that holds it)."""
    below = [b for b in BUCKETS if b < max_tokens]
    return below + [b for b in BUCKETS if b >= max_tokens][:1]


def supported(model: torch.nn.Module) -> bool:
    """Whether the model's forward can be cut at attention this way: rotary tables that depend on the
    sequences' lengths (dynamic scaling) read the step's metadata inside a piece, so those models step
    eagerly."""
    return not model.model.rotary_emb.dynamic


class PiecewiseGraphs:
    """The pieces of every bucket, and the static buffers they read and write."""

    def __init__(self, model: torch.nn.Module, max_tokens: int, capture: Capture) -> None:
        self.model = model
        self.decoder = model.model
        self.buckets = buckets_up_to(max_tokens)
        n, dev, dtype = self.buckets[-1], model.device, model.dtype
        attn = self.decoder.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        hidden = model.config.hidden_size
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.qkv = torch.zeros(n, self.q_size + 2 * self.kv_size, dtype=dtype, device=dev)
        self.attn_out = torch.zeros(n, self.heads, self.head_dim, dtype=dtype, device=dev)
        self.residual = torch.zeros(n, hidden, dtype=dtype, device=dev)
        self.hidden = torch.zeros(n, hidden, dtype=dtype, device=dev)
        self.pieces: dict[int, list[Callable[[], None]]] = {}
        for b in reversed(self.buckets):  # the largest first: the smaller ones reuse its memory
            self.pieces[b] = [capture(piece) for piece in self._pieces(b)]

    def bucket(self, tokens: int) -> Optional[int]:
        return next((b for b in self.buckets if b >= tokens), None)

    # --- the pieces ---------------------------------------------------------------------------------

    def _pieces(self, b: int) -> list[Callable[[], None]]:
        layers = self.decoder.layers
        pieces = [lambda: self._store(*layers[0].begin(self.decoder.embed_tokens(self.ids[:b]), None, self._rope(b)))]
        for i in range(1, len(layers)):
            pieces.append(lambda i=i: self._store(*layers[i].begin(*layers[i - 1].end(*self._ended(b)), self._rope(b))))
        pieces.append(lambda: self.hidden[:b].copy_(self.decoder.norm(*layers[-1].end(*self._ended(b)))[0]))
        return pieces

    def _rope(self, b: int) -> tuple[torch.Tensor, ...]:
        return self.decoder.rotary_emb.rows(self.positions[:b], None)

    def _ended(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attn_out[:b], self.residual[:b]

    def _store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual: torch.Tensor) -> None:
        b = q.shape[0]
        qs, ks = self.q_size, self.kv_size
        self.qkv[:b, :qs].copy_(q.reshape(b, qs))
        self.qkv[:b, qs:qs + ks].copy_(k.reshape(b, ks))
        self.qkv[:b, qs + ks:].copy_(v.reshape(b, ks))
        if residual.data_ptr() != self.residual.data_ptr():
            self.residual[:b].copy_(residual)

    # --- one step -----------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """hidden [T, hidden] of a step of T ≤ the largest bucket's tokens; a view of a static buffer that the
        next step overwrites."""
        t = input_ids.shape[0]
        b = self.bucket(t)
        self.ids[:t].copy_(input_ids)
        self.ids[t:b].zero_()
        self.positions[:t].copy_(positions)
        self.positions[t:b].zero_()
        qs, ks = self.q_size, self.kv_size
        q = self.qkv[:t, :qs].view(t, self.heads, self.head_dim)
        k = self.qkv[:t, qs:qs + ks].view(t, self.kv_heads, self.head_dim)
        v = self.qkv[:t, qs + ks:].view(t, self.kv_heads, self.head_dim)
        pieces = self.pieces[b]
        pieces[0]()
        for layer, piece in zip(self.decoder.layers, pieces[1:]):
            self.attn_out[:t].copy_(layer.self_attn.attn(q, k, v, meta))
            piece()
        return self.hidden[:t]
