"""BlockManager: which KV blocks are free, who holds each, and which full blocks hold which tokens.

A sequence's tokens live in fixed-size blocks listed in its block table. A block that is full and
computed is registered under a hash chained over all blocks before it (its own token ids and the hash
of the block before), so a later sequence that starts with the same tokens (a chat turn resending its
history, a shared system prompt) takes those blocks instead of recomputing them; a block is shared by
reference count and returns to the free list at 0. Freed blocks keep their hash until reused, oldest
freed first, so a finished conversation's blocks stay findable while the pool has room.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from quantkit.engine.sequence import Sequence

NO_HASH = -1


def block_hash(token_ids: list[int], prefix_hash: int) -> int:
    """The chained hash of a block: equal only for equal tokens after an equal prefix (collisions are
    caught by comparing the stored token ids)."""
    return hash((prefix_hash, tuple(token_ids)))


def chain_start(seq: Sequence) -> int:
    """The hash a sequence's chain starts from: its images' hash when it has images (two requests share
    blocks only after the same images), else NO_HASH."""
    images = getattr(seq, "images", None)
    return NO_HASH if images is None else images.hash


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids: list[int] = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest freed first
        self.hash_to_block: dict[int, int] = {}
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

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The blocks already holding seq's leading full blocks. The last token is always left to compute:
        its logits give the next token."""
        if not self.prefix_caching:
            return []
        found, h = [], chain_start(seq)
        for i in range((len(seq) - 1) // self.block_size):
            token_ids = seq.block(i, self.block_size)
            h = block_hash(token_ids, h)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != token_ids:
                break
            found.append(block_id)
        return found

    def can_allocate(self, seq: Sequence) -> bool:
        cached = self._cached_prefix(seq)
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)  # taken back from the free list
        return seq.num_blocks(self.block_size) - len(cached) + revived <= len(self.free)

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of seq's tokens, sharing cached ones; seq.num_computed_tokens = the cached prefix."""
        assert not seq.block_table, f"{seq} already holds blocks"
        cached = self._cached_prefix(seq)
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
        if block.hash != NO_HASH and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # evicted: its tokens are about to be overwritten
        block.hash, block.token_ids, block.ref_count = NO_HASH, [], 1
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
        h: Optional[int] = self.blocks[seq.block_table[start - 1]].hash if start > 0 else chain_start(seq)
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            block.token_ids = seq.block(i, self.block_size)
            h = block.hash = block_hash(block.token_ids, h)
            self.hash_to_block[h] = block.block_id
        self.num_hashed[seq.arrival] = max(start, end)
