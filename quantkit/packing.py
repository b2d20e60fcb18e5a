"""Small integers packed into int32 words: the arithmetic of every on-disk layout, shared by the formats
that write and read checkpoints and the kernels' torch reference that computes with them (both sit on
the lowest floor, beside config.py, and import this).

A word holds 32/b values of b bits; value i sits in bits b·i … b·i+b−1. In sequence, value i is column i
of the word's run of columns; AutoAWQ's "gemm" layout instead puts column AWQ_ORDER[i] in value i.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ gemm word holds column AWQ_ORDER[i] of its eight


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
