"""BlockManager: allocation, growth, and prefix caching by chained SHA-256 block keys."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from quantkit.engine import block_manager
from quantkit.engine.block_manager import ROOT, BlockManager, block_key
from quantkit.engine.multimodal import pixel_hash
from quantkit.engine.sequence import Sequence

BS = 4


def computed(bm: BlockManager, tokens: list[int], images=None) -> Sequence:
    """A sequence allocated and fully computed (its full blocks registered), as after its prefill."""
    seq = Sequence(tokens)
    seq.images = images
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    seq.num_computed_tokens = len(seq)
    bm.hash_blocks(seq)
    return seq


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def test_prefix_hit_shares_full_blocks_and_ref_counts_return_to_zero():
    bm = BlockManager(16, BS)
    a = computed(bm, list(range(1, 11)))                 # blocks [1..4] [5..8] [9 10]
    assert len(a.block_table) == 3 and bm.num_free_blocks == 13
    b = Sequence(list(range(1, 9)) + [50, 51, 52])       # same first two blocks, another tail
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert b.num_computed_tokens == 2 * BS
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == 12                     # only b's tail block is new
    bm.deallocate(a)
    bm.deallocate(b)
    assert ref_counts(bm) == [0] * 16 and bm.num_free_blocks == 16 and bm.usage == 0.0


def test_the_last_token_is_always_computed():
    bm = BlockManager(16, BS)
    computed(bm, list(range(1, 9)))                      # exactly two full blocks
    again = Sequence(list(range(1, 9)))
    bm.allocate(again)
    assert again.num_computed_tokens == BS               # block 2 holds the last token: recomputed for its logits


def test_a_scorer_caps_the_cached_prefix_at_the_first_position_it_wants_logits_of():
    bm = BlockManager(16, BS)
    computed(bm, list(range(1, 13)))                     # three full blocks registered
    capped = Sequence(list(range(1, 13)) + [40])
    assert bm.can_allocate(capped, max_cached_tokens=7)
    bm.allocate(capped, max_cached_tokens=7)             # logits wanted from position 7 on: block 1 is recomputed
    assert capped.num_computed_tokens == BS
    whole = Sequence(list(range(1, 9)))
    bm.allocate(whole, max_cached_tokens=8)              # no logits wanted: every full block from the cache
    assert whole.num_computed_tokens == 8 == len(whole)


def test_hash_is_chained_over_the_prefix():
    bm = BlockManager(16, BS)
    computed(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    other_start = Sequence([9, 9, 9, 9, 5, 6, 7, 8, 9])  # block 1 equal, block 0 not: no hit anywhere
    bm.allocate(other_start)
    assert other_start.num_computed_tokens == 0


def test_no_hits_without_prefix_caching():
    bm = BlockManager(16, BS, prefix_caching=False)
    computed(bm, list(range(1, 11)))
    b = Sequence(list(range(1, 11)))
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and bm.num_free_blocks == 10


def test_freed_blocks_are_found_again_until_reused():
    bm = BlockManager(6, BS)
    a = computed(bm, list(range(1, 11)))
    a_table = list(a.block_table)
    bm.deallocate(a)
    assert bm.num_free_blocks == 6
    b = Sequence(list(range(1, 11)))
    assert bm.can_allocate(b)
    bm.allocate(b)                                       # a's first two blocks come back from the free list
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a_table[:2]
    assert bm.num_free_blocks == 3
    bm.deallocate(b)
    filler = computed(bm, list(range(100, 124)))         # takes all 6 blocks: the cached ones are overwritten
    bm.deallocate(filler)
    c = Sequence(list(range(1, 11)))
    bm.allocate(c)
    assert c.num_computed_tokens == 0


def test_can_allocate_counts_revived_blocks_and_free_ones():
    bm = BlockManager(4, BS)
    a = computed(bm, list(range(1, 10)))                 # 3 blocks, 1 free
    assert not bm.can_allocate(Sequence(list(range(50, 59))))   # needs 3
    assert bm.can_allocate(Sequence(list(range(1, 10))))        # shares 2, needs 1
    a_table = list(a.block_table)
    bm.deallocate(a)                                     # free list: the spare block, then a's tail to head
    computed(bm, [70, 71, 72, 73, 74, 75, 76, 77])       # takes the spare and a's tail; a's head stays cached
    assert bm.num_free_blocks == 2
    assert not bm.can_allocate(Sequence(list(range(1, 10))))  # 2 cached but free + 1 new > 2 free
    short = Sequence([1, 2, 3, 4, 5])                    # 1 cached + 1 new
    assert bm.can_allocate(short)
    bm.allocate(short)
    assert short.block_table[0] == a_table[0] and short.num_computed_tokens == BS and bm.num_free_blocks == 0


def test_append_takes_a_block_only_at_a_block_boundary():
    bm = BlockManager(3, BS)
    seq = computed(bm, [1, 2, 3, 4])
    assert len(seq.block_table) == 1
    seq.append_token(5)                                  # token 5 starts block 1
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 1
    seq.append_token(6)
    bm.may_append(seq)
    assert len(seq.block_table) == 2
    for t in (7, 8, 9):
        seq.append_token(t)
    bm.may_append(seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 0
    for t in (10, 11, 12, 13):
        seq.append_token(t)
    assert not bm.can_append(seq)


def test_equal_blocks_after_different_prefixes_share_nothing_even_when_python_hash_collides(monkeypatch):
    """b's first block holds the tokens of a's second block; only the prefix differs. With Python's
    hash() forced to collide (the key of a scheme built on it), the block still is not shared."""
    monkeypatch.setattr(block_manager, "hash", lambda _: 0, raising=False)
    bm = BlockManager(16, BS)
    computed(bm, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    b = Sequence([5, 6, 7, 8, 5, 6, 7, 8, 0])
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_block_keys_pack_tokens_at_a_fixed_width_and_chain_the_prefix():
    assert block_key(ROOT, [1, 23]) != block_key(ROOT, [12, 3])
    assert block_key(ROOT, [1, 2]) != block_key(ROOT, [1, 2, 0])
    parent = block_key(ROOT, [7, 7])
    assert block_key(parent, [1, 2]) != block_key(ROOT, [1, 2])
    assert block_key(parent, [1, 2]) == block_key(block_key(ROOT, [7, 7]), [1, 2]) and len(parent) == 32


def test_blocks_after_different_images_are_never_shared():
    pixels = torch.arange(48, dtype=torch.float32).reshape(3, 4, 4)
    first, second = (SimpleNamespace(hash=pixel_hash([p])) for p in (pixels, pixels.flip(0)))
    tokens = list(range(1, 11))
    bm = BlockManager(16, BS)
    computed(bm, tokens, images=first)
    for images in (second, None):                        # other pixels, or no image: the same tokens miss
        other = Sequence(tokens)
        other.images = images
        bm.allocate(other)
        assert other.num_computed_tokens == 0
        bm.deallocate(other)
    again = Sequence(tokens)
    again.images = SimpleNamespace(hash=pixel_hash([pixels.clone()]))  # equal pixels, another tensor
    bm.allocate(again)
    assert again.num_computed_tokens == 2 * BS


def test_blocks_filled_while_decoding_are_keyed_after_the_prompt():
    bm = BlockManager(16, BS)
    a = computed(bm, list(range(1, 7)))                  # one full block, then two tokens of the next
    for t in (7, 8, 9, 10, 11):
        a.append_token(t)
        bm.may_append(a)
        a.num_computed_tokens = len(a) - 1              # as after a decode step: the newest token is uncomputed
        bm.hash_blocks(a)
    b = Sequence(list(range(1, 13)))
    bm.allocate(b)
    assert b.num_computed_tokens == 2 * BS and b.block_table[:2] == a.block_table[:2]
    c = Sequence([1, 2, 3, 4, 50, 6, 7, 8, 9])           # block 1 differs: only block 0 is shared
    bm.allocate(c)
    assert c.num_computed_tokens == BS


def test_a_waiting_prompt_is_hashed_once(monkeypatch):
    calls = []
    monkeypatch.setattr(block_manager, "block_key", lambda *a: calls.append(a) or block_key(*a))
    bm = BlockManager(4, BS)
    computed(bm, list(range(1, 13)))                     # 3 blocks cached and held, 1 free
    calls.clear()
    seq = Sequence(list(range(1, 22)))                   # 3 cached blocks + 3 new: more than the pool has
    for _ in range(3):                                   # as at each step while it waits for room
        assert not bm.can_allocate(seq)
    assert len(calls) == 4                               # 3 hits and the first miss, each hashed once
