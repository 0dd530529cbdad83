"""CacheManager: O(1) free queue, all-or-nothing allocation, and its invariants under random use."""

from __future__ import annotations

import random

import pytest

from scheduler.cache_manager import CacheManager

pytestmark = pytest.mark.unit


def test_allocate_free_reuses_lru_order() -> None:
    cm = CacheManager(total_blocks=8, block_size=4)
    assert cm.allocate_slots("a", 9)  # 3 blocks
    assert cm.get_block_table("a") == [0, 1, 2]
    assert cm.get_num_free_blocks() == 5
    assert cm.allocate_slots("a", 12)  # still 3 blocks
    assert cm.allocate_slots("a", 13)  # a 4th
    assert cm.get_block_table("a") == [0, 1, 2, 3]
    cm.free("a")
    # Blocks come back tail first, after the never-used ones.
    assert cm.free_queue.block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]
    cm.check_invariants()


def test_allocation_is_all_or_nothing() -> None:
    cm = CacheManager(total_blocks=4, block_size=16)
    assert cm.allocate_slots("a", 48)
    assert not cm.allocate_slots("b", 32)
    assert cm.get_block_table("b") == [] and "b" not in cm.block_tables
    assert not cm.allocate_slots("a", 80)
    assert len(cm.get_block_table("a")) == 3
    cm.check_invariants()


def test_ref_counts_and_double_free_detected() -> None:
    cm = CacheManager(total_blocks=4, block_size=16)
    ids = cm.allocate_blocks(2)
    cm.blocks[ids[0]].ref_cnt += 1  # shared, as a prefix-cache hit will do
    cm.free_blocks(ids)
    assert cm.get_num_free_blocks() == 3
    cm.free_blocks([ids[0]])
    assert cm.get_num_free_blocks() == 4
    with pytest.raises(AssertionError):
        cm.free_blocks([ids[0]])


def test_free_queue_remove_from_middle() -> None:
    cm = CacheManager(total_blocks=5, block_size=1)
    cm.free_queue.remove(cm.blocks[2])
    assert cm.free_queue.block_ids() == [0, 1, 3, 4]
    cm.free_queue.append(cm.blocks[2])
    assert cm.free_queue.block_ids() == [0, 1, 3, 4, 2]


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    cm = CacheManager(total_blocks=64, block_size=16)
    sizes: dict[str, int] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.35 or not sizes:
            rid = f"r{step}"
            n = rng.randint(1, 300)
            free_before = cm.get_num_free_blocks()
            ok = cm.allocate_slots(rid, n)
            assert ok == (cm.num_blocks_for(n) <= free_before)
            if ok:
                sizes[rid] = n
        elif op < 0.75:
            rid = rng.choice(sorted(sizes))
            n = sizes[rid] + rng.randint(1, 40)
            free_before = cm.get_num_free_blocks()
            need = cm.num_blocks_for(n) - len(cm.get_block_table(rid))
            ok = cm.allocate_slots(rid, n)
            assert ok == (need <= free_before)
            if ok:
                sizes[rid] = n
            else:
                assert cm.get_num_free_blocks() == free_before
        else:  # finish or abort: both free everything at once
            rid = rng.choice(sorted(sizes))
            cm.free(rid)
            del sizes[rid]
        for rid, n in sizes.items():
            assert len(cm.get_block_table(rid)) == cm.num_blocks_for(n)
        if step % 50 == 0:
            cm.check_invariants()
    for rid in list(sizes):
        cm.free(rid)
    cm.check_invariants()
    assert cm.get_num_free_blocks() == 64
