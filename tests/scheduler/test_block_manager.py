"""BlockManager: query-then-commit pairs, reference counts, prefix caching, LRU eviction."""

from __future__ import annotations

import pytest

from wavecore.engine.scheduler import BlockManager, BlockPoolExhaustedError


def _manager(num_blocks: int = 8, block_size: int = 4, caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=caching)


def _compute(manager: BlockManager, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Allocate for all of `tokens` (after any cached prefix) and register full blocks."""
    hit = manager.lookup_prefix(tokens)
    table = manager.allocate(hit, len(tokens))
    hashes = list(hit.block_hashes)
    manager.cache_full_blocks(table, hashes, tokens, len(tokens))
    return table, hashes


@pytest.mark.parametrize(
    ("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4), (True, 4), (4, 2.0)]
)
def test_bad_geometry_is_refused(num_blocks: object, block_size: object) -> None:
    with pytest.raises(ValueError, match=r"num_blocks|block_size"):
        BlockManager(num_blocks=num_blocks, block_size=block_size)  # type: ignore[arg-type]


def test_allocate_covers_the_requested_tokens_with_distinct_ids() -> None:
    manager = _manager()
    hit = manager.lookup_prefix([1, 2, 3, 4, 5])
    assert hit.num_tokens == 0
    table = manager.allocate(hit, 5)
    assert len(table) == 2 and len(set(table)) == 2
    assert all(0 <= block < 8 for block in table)
    assert manager.num_free_blocks == 6 and manager.num_used_blocks == 2
    assert manager.usage == pytest.approx(2 / 8)


def test_queries_do_not_change_anything() -> None:
    manager = _manager(num_blocks=2)
    hit = manager.lookup_prefix(list(range(20)))
    assert manager.can_allocate(hit, 8)
    assert not manager.can_allocate(hit, 9)
    assert manager.can_append([], 8) and not manager.can_append([], 9)
    assert manager.num_free_blocks == 2
    assert manager.prefix_cache_hit_rate == 0.0


def test_commit_without_room_raises_and_changes_nothing() -> None:
    manager = _manager(num_blocks=2)
    hit = manager.lookup_prefix([1] * 9)
    with pytest.raises(BlockPoolExhaustedError):
        manager.allocate(hit, 9)
    assert manager.num_free_blocks == 2
    table = manager.allocate(hit, 4)
    with pytest.raises(BlockPoolExhaustedError):
        manager.append(table, 12)
    assert table == table[:1] and manager.num_free_blocks == 1


def test_append_grows_the_table_in_place_only_when_needed() -> None:
    manager = _manager()
    table = manager.allocate(manager.lookup_prefix([1, 2]), 2)
    same = table
    manager.append(table, 4)
    assert len(table) == 1
    manager.append(table, 5)
    assert same is table and len(table) == 2


def test_free_returns_blocks_and_double_free_is_detected() -> None:
    manager = _manager()
    table = manager.allocate(manager.lookup_prefix([1, 2, 3]), 3)
    manager.free(table)
    assert manager.num_free_blocks == 8
    with pytest.raises(ValueError, match="freed more often"):
        manager.free(table)


def test_a_computed_prefix_is_shared_with_reference_counts() -> None:
    manager = _manager()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    first, _ = _compute(manager, prompt)
    hit = manager.lookup_prefix([*prompt[:8], 99, 98])
    assert hit.block_ids == tuple(first[:2]) and hit.num_tokens == 8
    second = manager.allocate(hit, 10)
    assert second[:2] == first[:2] and second[2] != first[2]
    assert [manager.ref_count(block) for block in first] == [2, 2, 1]
    assert manager.num_used_blocks == 4
    assert manager.prefix_cache_hit_rate == pytest.approx(8 / 20)


def test_at_least_one_token_is_left_to_compute() -> None:
    manager = _manager()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    _compute(manager, tokens)
    hit = manager.lookup_prefix(tokens)
    assert hit.num_tokens == 4  # the last full block would leave nothing to run


def test_a_different_first_block_shares_nothing() -> None:
    manager = _manager()
    _compute(manager, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Same second block, different first block: the chained key must not match.
    assert manager.lookup_prefix([0, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 0


def test_freed_cached_blocks_stay_free_and_reusable_until_evicted() -> None:
    manager = _manager(num_blocks=4)
    prompt = list(range(9))
    table, _ = _compute(manager, prompt)
    manager.free(table)
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 2
    hit = manager.lookup_prefix(prompt)
    assert hit.block_ids == tuple(table[:2])
    again = manager.allocate(hit, 9)
    assert again[:2] == table[:2]
    assert manager.num_free_blocks == 1


def test_reviving_cached_blocks_counts_against_free_space() -> None:
    manager = _manager(num_blocks=3)
    prompt = list(range(9))
    table, _ = _compute(manager, prompt)  # 3 blocks, 2 of them cached
    manager.free(table)
    hit = manager.lookup_prefix(prompt)
    assert manager.can_allocate(hit, 9)
    assert not manager.can_allocate(hit, 13)  # 2 revived + 2 new > 3 free


def test_eviction_takes_plain_blocks_first_then_least_recently_freed() -> None:
    manager = _manager(num_blocks=4, block_size=2)
    old, _ = _compute(manager, [1, 2, 3])  # blocks: [1,2] cached, [3] plain
    manager.free(old)
    new, _ = _compute(manager, [7, 8, 9])
    manager.free(new)
    # Free now: 2 plain (tails), cached LRU: [1,2] then [7,8].
    taken = manager.allocate(manager.lookup_prefix([50, 51, 52, 53, 54, 55]), 6)
    assert len(taken) == 3
    assert manager.lookup_prefix([1, 2, 3]).num_tokens == 0  # the older cached block went
    assert manager.lookup_prefix([7, 8, 9]).num_tokens == 2


def test_free_releases_the_tail_first_so_the_shared_head_survives_longer() -> None:
    manager = _manager(num_blocks=3, block_size=2)
    table, _ = _compute(manager, [1, 2, 3, 4, 5])  # [1,2] and [3,4] cached
    manager.free(table)
    manager.allocate(manager.lookup_prefix([9, 9, 9]), 3)  # takes the plain tail block + 1
    assert manager.lookup_prefix([1, 2, 3, 4, 5]).num_tokens == 2


def test_a_duplicate_prefix_computed_twice_keeps_one_cache_entry() -> None:
    manager = _manager()
    prompt = [5, 6, 7, 8, 9]
    first = manager.allocate(manager.lookup_prefix(prompt), 5)
    second = manager.allocate(manager.lookup_prefix(prompt), 5)
    manager.cache_full_blocks(first, [], prompt, 5)
    hashes: list[int] = []
    manager.cache_full_blocks(second, hashes, prompt, 5)
    assert len(hashes) == 1  # the chain continues even though the block is not registered
    assert manager.num_cached_blocks == 1
    manager.free(second)
    manager.free(first)
    assert manager.num_free_blocks == 8
    assert manager.lookup_prefix(prompt).block_ids == (first[0],)


def test_reset_prefix_cache_forgets_everything_cached() -> None:
    manager = _manager()
    table, _ = _compute(manager, list(range(9)))
    manager.lookup_prefix(list(range(9)))
    manager.reset_prefix_cache()
    assert manager.num_cached_blocks == 0 and manager.prefix_cache_hit_rate == 0.0
    assert manager.lookup_prefix(list(range(9))).num_tokens == 0
    manager.free(table)
    assert manager.num_free_blocks == 8


def test_disabled_prefix_caching_never_hits() -> None:
    manager = _manager(caching=False)
    table, hashes = _compute(manager, list(range(9)))
    assert hashes == [] and manager.num_cached_blocks == 0
    manager.free(table)
    assert manager.lookup_prefix(list(range(9))).num_tokens == 0


def test_allocate_below_the_hit_is_refused() -> None:
    manager = _manager()
    _compute(manager, list(range(9)))
    hit = manager.lookup_prefix(list(range(9)))
    with pytest.raises(ValueError, match="below the prefix hit"):
        manager.allocate(hit, 3)
