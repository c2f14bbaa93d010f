import random

import pytest

from specdec.block_manager import BlockManager, OutOfBlocks


def assert_consistent(bm: BlockManager):
    owned = [b for s in bm.seq_ids() for b in bm.block_table(s)]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert set(owned).isdisjoint(bm._free), "a block is both owned and free"
    assert len(owned) + bm.num_free == bm.num_blocks
    for s in bm.seq_ids():
        assert len(bm.block_table(s)) == bm.blocks_needed(bm.num_tokens(s))


def test_append_returns_slots_in_order_across_block_boundaries():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a")
    slots = bm.append("a", 6)
    table = bm.block_table("a")
    assert slots == [table[0] * 4 + i for i in range(4)] + [table[1] * 4 + i for i in range(2)]
    assert bm.append("a", 3) == [table[1] * 4 + 2, table[1] * 4 + 3, bm.block_table("a")[2] * 4]
    assert bm.num_tokens("a") == 9 and bm.num_used == 3


def test_truncate_frees_whole_blocks_only():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(1)
    bm.append(1, 10)
    bm.truncate(1, 5)
    assert bm.num_tokens(1) == 5 and len(bm.block_table(1)) == 2 and bm.num_free == 6
    bm.truncate(1, 0)
    assert bm.block_table(1) == [] and bm.num_free == 8
    with pytest.raises(ValueError):
        bm.truncate(1, 1)


def test_out_of_blocks_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a")
    bm.append("a", 5)
    before = (bm.block_table("a"), bm.num_tokens("a"), bm.num_free)
    with pytest.raises(OutOfBlocks, match="needs 1 more KV blocks, 0 free"):
        bm.append("a", 2)
    assert (bm.block_table("a"), bm.num_tokens("a"), bm.num_free) == before
    assert bm.can_append("a", 1) and not bm.can_append("a", 2)


def test_unknown_and_duplicate_sequences_are_errors():
    bm = BlockManager(num_blocks=2, block_size=2)
    bm.allocate("x")
    with pytest.raises(KeyError, match="already exists"):
        bm.allocate("x")
    with pytest.raises(KeyError, match="unknown sequence 'y'"):
        bm.append("y", 1)
    bm.free("y")  # freeing an unknown id is a no-op (release after an error must be safe)


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_invariants(seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=32, block_size=rng.choice([1, 4, 16]))
    next_id = 0
    for _ in range(2000):
        op = rng.random()
        live = bm.seq_ids()
        if op < 0.15 or not live:
            bm.allocate(next_id)
            next_id += 1
        elif op < 0.6:
            s = rng.choice(live)
            n = rng.randint(0, 40)
            free_before, tokens_before = bm.num_free, bm.num_tokens(s)
            try:
                slots = bm.append(s, n)
            except OutOfBlocks:
                assert bm.num_free == free_before and bm.num_tokens(s) == tokens_before
            else:
                assert len(slots) == len(set(slots)) == n
        elif op < 0.85:
            s = rng.choice(live)
            bm.truncate(s, rng.randint(0, bm.num_tokens(s)))
        else:
            bm.free(rng.choice(live))
        assert_consistent(bm)
    # every slot handed out is unique across all live sequences
    all_slots = set()
    for s in bm.seq_ids():
        table = bm.block_table(s)
        for t in range(bm.num_tokens(s)):
            slot = table[t // bm.block_size] * bm.block_size + t % bm.block_size
            assert slot not in all_slots
            all_slots.add(slot)
    for s in bm.seq_ids():
        bm.free(s)
    assert bm.num_free == bm.num_blocks and bm.num_used == 0
