"""BlockManager: which KV blocks are free, who holds each, and which full blocks hold which tokens.

A sequence's tokens live in fixed-size blocks listed in its block table. A block that is full and
computed is registered under a key chained over all blocks before it: the SHA-256 of the key of the
block before (or of the chain's start: the sequence's images, else `ROOT`) and its own token ids, packed
as 64-bit integers. A later sequence that starts with the same tokens (a chat turn resending its
history, a shared system prompt) takes those blocks instead of recomputing them; a block is shared by
reference count and returns to the free list at 0. The key alone decides a hit, so it is a
cryptographic hash: two different prefixes would need a SHA-256 collision to share KV (Python's
`hash()` of a tuple is cheap to collide, vLLM's CVE-2025-25183). Freed blocks keep their key until
reused, oldest freed first, so a finished conversation's blocks stay findable while the pool has room.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Optional

from quantkit.engine.sequence import Sequence

ROOT = bytes(32)  # the chain's start for a sequence without images; every parent key is 32 bytes


def block_key(parent: bytes, token_ids: list[int]) -> bytes:
    """The chained key of a full block: SHA-256 over the parent's 32-byte key and the token ids as
    fixed-width int64 (so [1, 23] and [12, 3] differ). Equal only for equal tokens after an equal prefix."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def chain_start(seq: Sequence) -> bytes:
    """The key a sequence's chain starts from: its images' SHA-256 digest when it has images (two requests
    share blocks only after the same images), else ROOT."""
    images = getattr(seq, "images", None)
    if images is None:
        return ROOT
    assert isinstance(images.hash, bytes) and len(images.hash) == 32, "images.hash must be a SHA-256 digest"
    return images.hash


class Block:
    __slots__ = ("block_id", "ref_count", "key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.key: Optional[bytes] = None  # set while the block is registered in the prefix cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest freed first
        self.key_to_block: dict[bytes, int] = {}
        self.num_hashed: dict[int, int] = {}  # sequence arrival → its leading blocks already registered
        self.prefix_queries = 0  # tokens of admitted sequences looked up in the prefix cache (monitoring)
        self.prefix_hits = 0     # of those, tokens found there

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by sequences."""
        return 1.0 - len(self.free) / self.num_blocks

    # --- admission --------------------------------------------------------------------------------

    def _cached_prefix(self, seq: Sequence, max_cached_tokens: Optional[int] = None) -> list[int]:
        """The blocks already holding seq's leading full blocks, up to `max_cached_tokens` tokens. By default the
        last token is left to compute: its logits give the next token (a scorer that wants the logits of every
        token from some position on passes that position)."""
        if not self.prefix_caching:
            return []
        limit = len(seq) - 1 if max_cached_tokens is None else min(max_cached_tokens, len(seq))
        found = []
        for i in range(limit // self.block_size):
            block_id = self.key_to_block.get(self._key(seq, i))
            if block_id is None:
                break
            found.append(block_id)
        return found

    def _key(self, seq: Sequence, i: int) -> bytes:
        """The key of seq's full block i, computed once per sequence (its tokens only grow), so a prompt
        waiting for room is not rehashed at every step."""
        keys = seq.block_keys
        while len(keys) <= i:
            parent = keys[-1] if keys else chain_start(seq)
            tokens = seq.block(len(keys), self.block_size)
            assert len(tokens) == self.block_size, f"{seq}: block {len(keys)} is not full"
            keys.append(block_key(parent, tokens))
        return keys[i]

    def can_allocate(self, seq: Sequence, max_cached_tokens: Optional[int] = None) -> bool:
        cached = self._cached_prefix(seq, max_cached_tokens)
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)  # taken back from the free list
        return seq.num_blocks(self.block_size) - len(cached) + revived <= len(self.free)

    def allocate(self, seq: Sequence, max_cached_tokens: Optional[int] = None) -> None:
        """Blocks for all of seq's tokens, sharing cached ones (at most `max_cached_tokens` tokens' worth, see
        `_cached_prefix`); seq.num_computed_tokens = the cached prefix."""
        assert not seq.block_table, f"{seq} already holds blocks"
        cached = self._cached_prefix(seq, max_cached_tokens)
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        while len(seq.block_table) < seq.num_blocks(self.block_size):
            seq.block_table.append(self._take_free_block())
        seq.num_computed_tokens = len(cached) * self.block_size
        self.num_hashed[seq.arrival] = len(cached)
        self.prefix_queries += len(seq)
        self.prefix_hits += seq.num_computed_tokens

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.key is not None and self.key_to_block.get(block.key) == block_id:
            del self.key_to_block[block.key]  # evicted: its tokens are about to be overwritten
        block.key, block.ref_count = None, 1
        return block_id

    def deallocate(self, seq: Sequence) -> None:
        # The last blocks go back first, so the free list evicts a sequence's tail before its head.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        self.num_hashed.pop(seq.arrival, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block's key and zero the prefix-cache counters; only while no sequence holds
        a block (after the engine's warm-up traffic, whose prompts no user sent)."""
        if len(self.free) != self.num_blocks:
            raise RuntimeError("the prefix cache is reset only while every block is free")
        for block in self.blocks:
            block.key = None
        self.key_to_block.clear()
        self.num_hashed.clear()
        self.prefix_queries = self.prefix_hits = 0

    # --- growth -----------------------------------------------------------------------------------

    def can_append(self, seq: Sequence) -> bool:
        """Whether the free list has the blocks seq needs for the tokens it has (one new token per decode)."""
        return seq.num_blocks(self.block_size) - len(seq.block_table) <= len(self.free)

    def may_append(self, seq: Sequence) -> None:
        while len(seq.block_table) < seq.num_blocks(self.block_size):
            seq.block_table.append(self._take_free_block())

    def hash_blocks(self, seq: Sequence) -> None:
        """Register the blocks that seq's computed tokens have filled since the last call."""
        if not self.prefix_caching:
            return
        start = self.num_hashed.get(seq.arrival, 0)
        end = seq.num_computed_tokens // self.block_size
        if end <= start:  # no block filled since the last call: most decode steps
            return
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            block.key = self._key(seq, i)
            self.key_to_block[block.key] = block.block_id
        self.num_hashed[seq.arrival] = max(start, end)
