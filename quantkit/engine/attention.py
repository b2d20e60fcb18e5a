"""Attention over the paged KV cache, and the step's metadata that every layer reads.

The model runner describes a step once (an `AttnMetadata`) and passes it to the model's forward,
which hands it to each layer's `Attention`. A step is either pure decode (one query token per
sequence: the path CUDA graphs replay, whose captured forward holds the graph's static metadata) or
a packed prefill (several sequences' new tokens back to back, possibly after a cached prefix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.kernels import paged_kv
from quantkit.kernels.paged_kv import HostLens


@dataclass
class AttnMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id·block_size + offset) of each new token; < 0 skips
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32: tokens in the cache after this step's write
    query_start: torch.Tensor  # [B+1] int32: sequence b's new tokens are query_start[b]:query_start[b+1]
    is_decode: bool  # every sequence has exactly one new token
    # A mixed step (prefill chunks and decodes together): its first `num_decode` sequences have one new token
    # each (the scheduler puts decodes first) and run through the batched decode kernel; `prefill` holds
    # (block_tables, context_lens, query_start renumbered from 0, their host lists) of the rest, cut once per step.
    num_decode: int = 0
    prefill: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[HostLens]]] = None
    # (query_start, context_lens) as host lists, from whoever built the step (the runner has them before
    # copying them to the device): the prefill attention's loop bounds, so that no layer waits for a copy
    # back to the host. None: each prefill attention reads them from the device.
    host_lens: Optional[HostLens] = None

    def token_seq_lens(self) -> torch.Tensor:
        """[T]: the context length of each new token's sequence."""
        if self.is_decode:
            return self.context_lens
        counts = (self.query_start[1:] - self.query_start[:-1]).long()
        return torch.repeat_interleave(self.context_lens, counts)


def causal_attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start: torch.Tensor,
                            sm_scale: float) -> torch.Tensor:
    """Causal attention of packed sequences over their own new tokens only (no cache: the runner's
    warm-up before the KV pool exists). q [T, heads, D], k/v [T, kv_heads, D] → [T, heads, D]."""
    out = torch.empty_like(q)
    bounds = query_start.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=sm_scale, enable_gqa=True
        ).transpose(0, 1)
    return out


class Attention(nn.Module):
    """Writes this step's K/V into the layer's paged cache, then attends over the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sm_scale = sm_scale
        self.kv_cache: Optional[paged_kv.PagedKV] = None
        # [kv_heads, head_dim]: what a rotated pool subtracts from every key first (engine/kv_scales.py
        # key_centers, from the checkpoint's KV statistics); None: keys are rotated as they are.
        self.k_center: Optional[torch.Tensor] = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """q [T, heads, D], k/v [T, kv_heads, D] → [T, heads, D], for the step `meta` describes."""
        cache = self.kv_cache
        if cache is None:
            return causal_attention_packed(q, k, v, meta.query_start, self.sm_scale)
        if cache.rotation is not None:  # the pool holds keys centred and rotated (kernels/kv_rotation.py)
            q, k = cache.rotation.rotate(q, k, self.k_center)
        paged_kv.write_kv(cache, k, v, meta.slot_mapping)
        if meta.is_decode:
            return paged_kv.paged_decode_attention(q, cache, meta.block_tables, meta.context_lens, self.sm_scale)
        nd = meta.num_decode
        if nd == 0 or meta.prefill is None:
            return paged_kv.paged_prefill_attention(
                q, cache, meta.block_tables, meta.context_lens, meta.query_start, self.sm_scale, meta.host_lens
            )
        # Decodes batched in one kernel launch, not one gather + SDPA each (a mixed step of 256 decodes
        # would otherwise launch thousands of kernels per layer).
        out = torch.empty_like(q)
        out[:nd] = paged_kv.paged_decode_attention(q[:nd], cache, meta.block_tables[:nd], meta.context_lens[:nd],
                                                   self.sm_scale)
        tables, lens, starts, host = meta.prefill
        out[nd:] = paged_kv.paged_prefill_attention(q[nd:], cache, tables, lens, starts, self.sm_scale, host)
        return out
