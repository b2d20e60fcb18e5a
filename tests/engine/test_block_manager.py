"""BlockManager: allocation, growth, and prefix caching by chained block hashes."""

from __future__ import annotations

from quantkit.engine.block_manager import BlockManager
from quantkit.engine.sequence import Sequence

BS = 4


def computed(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence allocated and fully computed (its full blocks registered), as after its prefill."""
    seq = Sequence(tokens)
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
