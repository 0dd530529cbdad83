"""KV-cache groups of a hybrid model: one block pool, one `CacheManager` per attention type.

A hybrid model (Gemma 2/3, gpt-oss: some layers see a sliding window, some everything) splits its
layers into groups of equal size by attention type (the executor's `executor.kv_groups`), so a
block of any group holds the same bytes: one layer slot's K/V for ``block_size`` tokens of each
of the group's layers. The groups share one pool and the prefix cache; each request holds one
table per group, all of the same length (a window group's leading entries become the null block
as its blocks leave the window; the full-attention group keeps every block), as vLLM's hybrid
allocator does.

`HybridCacheManager` answers the scheduler as a `CacheManager` does. A request's table as the
executor sees it is the groups' tables interleaved: entry ``i * G + g`` is group ``g``'s block
``i`` (so growing a table appends whole rows, and a prefix hit is a list in the same layout).
Allocation is all or nothing across groups; a prefix hit is the longest prefix every group can
serve (each group's hit is recomputed within the shortest so far until they agree), and its cache
keys carry the group, so groups never share a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from common.config import ExecutorInfo, SchedulerConfig
from scheduler.cache_manager import CacheManager
from scheduler.prefix_summary import PrefixSummary

if TYPE_CHECKING:
    from scheduler.request import Request


class HybridCacheManager:
    """The KV-cache groups' managers over one pool (see the module doc).

    ``windows``: per group, its layers' sliding window (None: full attention). With
    ``free_window_blocks`` off, window groups keep every block too (same layout, no freeing).
    """

    def __init__(
        self,
        total_blocks: int,
        block_size: int,
        windows: Sequence[int | None],
        free_window_blocks: bool = True,
        wait_for_cache: bool = False,
    ) -> None:
        assert len(windows) > 1, "a single group is a plain CacheManager"
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.null_block = total_blocks
        first: CacheManager | None = None
        self.groups: list[CacheManager] = []
        for g, window in enumerate(windows):
            manager = CacheManager(
                total_blocks,
                block_size,
                window if free_window_blocks else None,
                wait_for_cache,
                pool=first,
                group_key=bytes([1, g]),
            )
            first = first or manager
            self.groups.append(manager)
        self.pool = self.groups[0]

    # -- pool level -------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.pool.free_queue.num_free

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_evictions(self) -> int:
        return sum(g.num_evictions for g in self.groups)

    @property
    def num_cached_blocks(self) -> dict[str, int]:
        """Per request, how many of its leading blocks are registered (the same in every group)."""
        return self.pool.num_cached_blocks

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()  # the map is shared by every group

    @property
    def summary(self) -> PrefixSummary:
        """What the shared prefix cache holds (every group's entries: `scheduler.prefix_summary`)."""
        return self.pool.summary

    # -- request level ----------------------------------------------------------------------
    def _split(self, blocks: Sequence[int]) -> list[Sequence[int]]:
        n = len(self.groups)
        return [blocks[g::n] for g in range(n)]

    def blocks_short(self, num_tokens: int, computed_blocks: Sequence[int] = ()) -> int:
        """How many more free blocks admitting ``num_tokens`` with the hit ``computed_blocks``
        (interleaved) needs than the pool has, over every group (0 or less: it fits)."""
        free = self.pool.free_queue.num_free
        hits = self._split(computed_blocks)
        return sum(g.blocks_short(num_tokens, hit) + free for g, hit in zip(self.groups, hits)) - free

    def blocks_freed_by(self, request_ids: Sequence[str], keep: Sequence[int] = ()) -> int:
        """Blocks freeing ``request_ids`` would return, less those in ``keep`` (groups share none)."""
        return sum(g.blocks_freed_by(request_ids, keep) for g in self.groups)

    def allocate_slots(
        self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = (), num_computed_tokens: int = 0
    ) -> bool:
        """Grow every group's table of ``request_id`` to ``num_tokens`` tokens, all or nothing
        (see `CacheManager.allocate_slots`; ``computed_blocks`` interleaved)."""
        if computed_blocks:
            if self.blocks_short(num_tokens, computed_blocks) > 0:
                return False
            # Every group takes its hit before any allocates: allocating could evict a hit block.
            hits = self._split(computed_blocks)
            for g, hit in zip(self.groups, hits):
                assert request_id not in g.block_tables, "a cache hit is only taken on admission"
                g.take_hit(request_id, hit)
            num_computed_tokens = len(hits[0]) * self.block_size
        for g in self.groups:
            g.remove_skipped_blocks(request_id, num_computed_tokens)
        need = sum(g.num_blocks_for(num_tokens) - len(g.block_tables.get(request_id, ())) for g in self.groups)
        if need > self.pool.free_queue.num_free:
            assert not computed_blocks, "the hit's room was counted"
            return False
        for g in self.groups:
            assert g.allocate_slots(request_id, num_tokens, (), num_computed_tokens), "the room was counted"
        return True

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for g in self.groups:
            g.remove_skipped_blocks(request_id, num_computed_tokens)

    def num_skipped(self, request_id: str) -> int:
        """Null entries of ``request_id``'s tables, all groups together (grows when any group's does)."""
        return sum(g.num_skipped(request_id) for g in self.groups)

    def free(self, request_id: str) -> None:
        for g in self.groups:
            g.free(request_id)

    def get_block_table(self, request_id: str) -> list[int]:
        """The groups' tables of ``request_id`` interleaved (entry ``i * G + g``: group g's block i)."""
        tables = [g.block_tables.get(request_id, []) for g in self.groups]
        assert all(len(t) == len(tables[0]) for t in tables), "group tables differ in length"
        return [b for row in zip(*tables) for b in row]

    # -- prefix cache -----------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest prefix every group can serve, as ``(interleaved block ids, tokens)``.

        Each group's hit is looked up within the shortest so far until all agree (a window
        group's hit within a shorter prefix is another run of blocks, so it is looked up again)."""
        limit = request.num_tokens - 1
        n = limit // self.block_size
        hashes = self.pool.block_hashes(request, limit)[:n]
        keys = [g.keys(hashes) for g in self.groups]
        while True:
            hits = [g.hit_blocks(k[:n])[:n] for g, k in zip(self.groups, keys)]
            shortest = min(len(h) for h in hits)
            if shortest == n:
                break
            n = shortest
        return [b for row in zip(*hits) for b in row], n * self.block_size

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for g in self.groups:
            g.cache_full_blocks(request, num_computed_tokens)

    # -- invariants -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every group's tables, then the shared pool against all of their references."""
        refs = [0] * self.total_blocks
        for g in self.groups:
            g.count_table_refs(refs)
        tables = [set(g.block_tables) for g in self.groups]
        assert all(t == tables[0] for t in tables), "a request holds tables in some groups only"
        self.pool.check_pool(refs, bool(tables[0]))


KVCacheManager = CacheManager | HybridCacheManager


def cache_manager_for(info: ExecutorInfo, config: SchedulerConfig) -> KVCacheManager:
    """The block pool of ``info``'s executor: one group per attention type for a hybrid model
    (``info.kv_group_windows``), window-aware when its model and ``config`` allow."""
    if len(info.kv_group_windows) > 1:
        windows = [w or None for w in info.kv_group_windows]
        return HybridCacheManager(
            info.num_blocks, info.block_size, windows, config.free_window_blocks, config.enable_prefix_caching
        )
    window = info.sliding_window if config.free_window_blocks else None
    return CacheManager(info.num_blocks, info.block_size, window, config.enable_prefix_caching)
