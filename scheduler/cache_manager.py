"""Paged KV block table: a preallocated block pool with an O(1) free-block queue, and the prefix cache.

Invariant (checked by `check_invariants`): every block is either in the free queue with
``ref_cnt == 0`` or referenced by at least one request's block table with ``ref_cnt`` equal to the
number of tables holding it — never both. Blocks are handed out from the queue's head and
returned to its tail, so the least recently freed block is reused first.

Prefix caching (vLLM v1 style; the scheduler decides whether it is used, see
`SchedulerConfig.enable_prefix_caching`): a block whose ``block_size`` tokens have all been
computed is registered under a hash of its content chained to its parent's
(`hash_block`), so one hash names a whole prefix. A new request takes the longest run of its
leading full blocks found in the cache (`get_computed_blocks`), sharing them by reference count.
A freed block keeps its hash while it waits in the free queue: it is still a cache entry, and only
when `allocate_blocks` hands it out again (LRU: the least recently freed first) is the entry
dropped. The executor never writes into a full block again unless it is reallocated, so a cached
block's K/V stays valid; blocks are registered only after the step that computed them succeeded
(`cache_full_blocks`), so a failed step never leaves a half-written block in the cache.

Sliding windows (vLLM's sliding-window manager; ``sliding_window`` W, when every attention layer
has the same window): a query at position p sees keys p - W + 1 .. p only, so once a request has
``num_computed_tokens`` c, the step that computes its next tokens needs nothing before c - W + 1.
`remove_skipped_blocks` frees its blocks wholly before that (they keep their cache entries, as
any freed block) and puts the null block in their place: id ``total_blocks``, one past the pool,
which the executor keeps zero (never allocated, never written, so its K/V stay finite) and which
attention reads only where the window masks it. A prefix hit then needs only its last
cdiv(W - 1, block_size) blocks cached; the earlier ones come back as null blocks
(`get_computed_blocks`). Without a window nothing changes.

Hybrid models (some layers windowed, some full) run one `CacheManager` per KV-cache group over
one shared pool (``pool``), each keying its cache entries with its ``group_key``: see
`scheduler.kv_groups`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.prefix_hash import ROOT_HASH, BlockHash, extra_keys, hash_block, summary_key
from scheduler.prefix_summary import PrefixSummary

if TYPE_CHECKING:
    from scheduler.request import Request


@dataclass(slots=True)
class KVBlock:
    """One block of the pool, doubling as a node of the intrusive free list."""

    block_id: int
    ref_cnt: int = 0
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None
    in_free_queue: bool = False
    block_hash: BlockHash | None = None  # set while the block is a prefix-cache entry


class FreeBlockQueue:
    """Doubly linked list of free blocks: popleft, append and remove-from-middle are O(1)."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        # Sentinels avoid None checks at both ends.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        assert not block.in_free_queue, f"block {block.block_id} freed twice"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        block.in_free_queue = True
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        assert block.in_free_queue, f"block {block.block_id} is not free"
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        block.in_free_queue = False
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        assert first is not None and first is not self._tail, "no free block"
        self.remove(first)
        return first

    def block_ids(self) -> list[int]:
        out, node = [], self._head.next_free
        while node is not None and node is not self._tail:
            out.append(node.block_id)
            node = node.next_free
        return out


class CacheManager:
    """Owns the block pool and every request's block table (the scheduler's view of KV memory).

    ``sliding_window``: the window every attention layer shares (None: some layer sees everything,
    or window-aware freeing is off); with one, tables name the null block ``total_blocks`` in
    place of the blocks behind the window (see the module doc). ``wait_for_cache`` (prefix caching
    on): a block leaves the window only once registered, so a step in flight that computed it
    still leaves its cache entry behind.
    """

    def __init__(
        self,
        total_blocks: int,
        block_size: int,
        sliding_window: int | None = None,
        wait_for_cache: bool = False,
        *,
        pool: CacheManager | None = None,
        group_key: bytes = b"",
    ) -> None:
        assert total_blocks > 0 and block_size > 0
        assert sliding_window is None or sliding_window > 0
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.wait_for_cache = wait_for_cache
        # A KV-cache group (`scheduler.kv_groups`) shares ``pool``'s blocks, free queue and prefix
        # cache, keys its entries with ``group_key``, and may name the null block in any group.
        self.group_key = group_key
        grouped = pool is not None or bool(group_key)
        self.null_block = total_blocks if sliding_window is not None or grouped else -1  # -1: no table names it
        if pool is None:
            self.blocks = [KVBlock(i) for i in range(total_blocks)]
            self.free_queue = FreeBlockQueue(self.blocks)
            # Prefix cache: content hash -> the block holding it (one block per hash: when two
            # requests computed the same block side by side, the first registered wins and the
            # other copy stays private).
            self.cached_blocks: dict[BlockHash, KVBlock] = {}
            self.summary = PrefixSummary()  # what gateways are told the cache holds
        else:
            assert pool.total_blocks == total_blocks and pool.block_size == block_size
            self.blocks, self.free_queue, self.cached_blocks = pool.blocks, pool.free_queue, pool.cached_blocks
            self.summary = pool.summary
        self.block_tables: dict[str, list[int]] = {}
        # Per request, how many leading entries of its table are the null block (window only).
        self.num_skipped_blocks: dict[str, int] = {}
        # Per request, how many of its leading blocks are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.num_evictions = 0

    # -- pool level -------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def allocate_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks off the free queue (ref count 1 each). Raises if fewer are free."""
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evict the least recently used cache entry
                self.drop_entry(block.block_id)
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block.block_id)
        return out

    def drop_entry(self, block_id: int) -> None:
        """Drop block ``block_id``'s prefix-cache entry, if it has one (its K/V is no longer a hit)."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached_blocks[block.block_hash]
            self.summary.removed(block.block_hash)
            block.block_hash = None

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero go back to the free queue.

        Callers pass a table in reverse so a request's tail blocks are evicted first: its head
        blocks are the ones the prefix cache is likeliest to hit (and a child block is useless
        without its parent). A freed block keeps its cache entry until it is reallocated.
        """
        for block_id in block_ids:
            if block_id == self.null_block:
                continue
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"block {block_id} freed with ref_cnt 0"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    # -- request level ----------------------------------------------------------------------
    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_short(self, num_tokens: int, computed_blocks: Sequence[int] = ()) -> int:
        """How many more free blocks a new request's `allocate_slots` of ``num_tokens`` with the
        hit ``computed_blocks`` needs than the pool has (0 or less: it fits)."""
        need = self.num_blocks_for(num_tokens) - len(computed_blocks)
        reclaimed = sum(1 for b in computed_blocks if b != self.null_block and self.blocks[b].ref_cnt == 0)
        return need + reclaimed - self.free_queue.num_free

    def blocks_freed_by(self, request_ids: Sequence[str], keep: Sequence[int] = ()) -> int:
        """How many blocks freeing ``request_ids`` would add to the free queue, less those in
        ``keep`` (a hit whose admission takes them straight back): a block shared with others stays."""
        dropped: dict[int, int] = {}
        for request_id in request_ids:
            for block_id in self.block_tables.get(request_id, ()):
                if block_id == self.null_block:
                    continue
                dropped[block_id] = dropped.get(block_id, 0) + 1
        kept = set(keep)
        return sum(1 for b, n in dropped.items() if n == self.blocks[b].ref_cnt and b not in kept)

    def allocate_slots(
        self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = (), num_computed_tokens: int = 0
    ) -> bool:
        """Grow ``request_id``'s table to hold ``num_tokens`` tokens, all or nothing.

        ``computed_blocks`` (only for a request that holds no blocks yet): its prefix-cache hit,
        from `get_computed_blocks`; they head the table, shared, and count as registered.
        ``num_computed_tokens``: the tokens it has computed (with a window, the blocks before its
        window are freed first: `remove_skipped_blocks`).
        """
        if computed_blocks:
            return self._allocate_with_hit(request_id, num_tokens, computed_blocks)
        self.remove_skipped_blocks(request_id, num_computed_tokens)
        table = self.block_tables.setdefault(request_id, [])
        need = self.num_blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.free_queue.num_free:
            if not table:
                del self.block_tables[request_id]
            return False
        table.extend(self.allocate_blocks(need))
        return True

    def _allocate_with_hit(self, request_id: str, num_tokens: int, computed_blocks: Sequence[int]) -> bool:
        assert request_id not in self.block_tables, "a cache hit is only taken on admission"
        need = self.num_blocks_for(num_tokens) - len(computed_blocks)
        # A hit block that sits in the free queue leaves it: it is no longer free to allocate.
        if self.blocks_short(num_tokens, computed_blocks) > 0:
            return False
        # Take the hit before allocating: allocating could otherwise evict one of its blocks.
        self.take_hit(request_id, computed_blocks)
        self.remove_skipped_blocks(request_id, len(computed_blocks) * self.block_size)
        if need > 0:
            self.block_tables[request_id].extend(self.allocate_blocks(need))
        return True

    def take_hit(self, request_id: str, computed_blocks: Sequence[int]) -> None:
        """Start ``request_id``'s table with its prefix-cache hit, shared (they count as registered)."""
        skipped = 0
        for block_id in computed_blocks:
            if block_id == self.null_block:
                skipped += 1
                continue
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
        hit = (self.blocks[b].block_hash for b in reversed(computed_blocks) if b != self.null_block)
        self.summary.used(h for h in hit if h is not None)
        self.block_tables[request_id] = list(computed_blocks)
        self.num_cached_blocks[request_id] = len(computed_blocks)
        if skipped:
            self.num_skipped_blocks[request_id] = skipped

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """With a window: free ``request_id``'s blocks wholly before ``num_computed_tokens - W + 1``
        (the first token it computes next sees keys from there on) and null them in its table.

        They keep their cache entries (freed oldest first, so evicted first). A step in flight that
        still reads one is safe: the executor runs steps in order, so whoever is given the block
        writes it only after."""
        if self.sliding_window is None:
            return
        table = self.block_tables.get(request_id)
        if not table:
            return
        first = min(max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size, len(table))
        if self.wait_for_cache:
            first = min(first, self.num_cached_blocks.get(request_id, 0))
        done = self.num_skipped_blocks.get(request_id, 0)
        if first <= done:
            return
        freed = table[done:first]
        table[done:first] = [self.null_block] * (first - done)
        self.num_skipped_blocks[request_id] = first
        self.free_blocks(freed)

    def num_skipped(self, request_id: str) -> int:
        """How many leading entries of ``request_id``'s table are the null block."""
        return self.num_skipped_blocks.get(request_id, 0)

    def free(self, request_id: str) -> None:
        """Release every block of ``request_id`` (no-op if it holds none); cached ones stay cached."""
        self.num_cached_blocks.pop(request_id, None)
        self.num_skipped_blocks.pop(request_id, None)
        table = self.block_tables.pop(request_id, None)
        if table:
            self.free_blocks(table[::-1])

    # -- prefix cache -----------------------------------------------------------------------
    def block_hashes(self, request: Request, num_tokens: int) -> list[BlockHash]:
        """``request``'s chained hashes of its full blocks within its first ``num_tokens`` tokens.

        Kept on the request (``request.block_hashes``) and only extended: each block is hashed
        once in the request's life, preemptions included. They depend on ``block_size``, so the
        scheduler clears them when it moves to a pool of another geometry.
        """
        hashes = request.block_hashes
        bs = self.block_size
        n = num_tokens // bs
        if len(hashes) < n:
            parent = hashes[-1] if hashes else ROOT_HASH
            for i in range(len(hashes), n):
                extra = extra_keys(request.cache_salt) if i == 0 else b""
                parent = hash_block(parent, request.tokens_between(i * bs, (i + 1) * bs), extra)
                hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of ``request`` as ``(block ids, tokens)``; nothing is taken.

        The hit never covers the last token (at most ``num_tokens - 1`` tokens, in whole blocks):
        the step that computes it samples the next one. A prompt of exactly ``k`` blocks, all
        cached, therefore recomputes its last block: a cached block is never written again.
        """
        limit = request.num_tokens - 1
        hashes = self.block_hashes(request, limit)[: limit // self.block_size]
        hit = self.hit_blocks(self.keys(hashes))
        return hit, len(hit) * self.block_size

    def keys(self, hashes: list[BlockHash]) -> list[BlockHash]:
        """This group's prefix-cache keys of ``hashes`` (the hashes themselves with one group)."""
        key = self.group_key
        return [h + key for h in hashes] if key else hashes

    def hit_blocks(self, keys: list[BlockHash]) -> list[int]:
        """The longest hit of a prefix whose blocks have the cache keys ``keys`` (see
        `get_computed_blocks`): from the start, or under the window from the right."""
        if self.sliding_window is not None:
            return self._window_hit(keys)
        out: list[int] = []
        for h in keys:
            block = self.cached_blocks.get(h)
            if block is None:
                break
            out.append(block.block_id)
        return out

    def _window_hit(self, hashes: list[BlockHash]) -> list[int]:
        """The longest hit under the window: the furthest run of ``cdiv(W - 1, block_size)``
        cached blocks (what the next token's window reaches back over), null blocks before it;
        failing that, the run of cached blocks from the start (a hit the window covers whole)."""
        assert self.sliding_window is not None
        needed = max(1, -(-(self.sliding_window - 1) // self.block_size))
        run = 0
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in self.cached_blocks:
                run += 1
                if run == needed:
                    tail = [self.cached_blocks[h].block_id for h in hashes[i : i + needed]]
                    return [self.null_block] * i + tail
            else:
                run = 0
        return [self.cached_blocks[h].block_id for h in hashes[:run]]

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register ``request``'s blocks full within its first ``num_computed_tokens`` tokens, once
        the step that computed them has succeeded (a later step may already be scheduled)."""
        request_id = request.request_id
        table = self.block_tables.get(request_id)
        if not table:
            return
        done = self.num_cached_blocks.get(request_id, 0)
        n = min(num_computed_tokens // self.block_size, len(table))
        if n <= done:
            return
        hashes = self.keys(self.block_hashes(request, n * self.block_size))
        for i in range(done, n):
            if table[i] == self.null_block:  # out of the window before its step answered: nothing to keep
                continue
            block = self.blocks[table[i]]
            if block.block_hash is None and hashes[i] not in self.cached_blocks:
                block.block_hash = hashes[i]
                self.cached_blocks[hashes[i]] = block
                self.summary.added(hashes[i])
        self.num_cached_blocks[request_id] = n

    def reset_prefix_cache(self) -> None:
        """Drop every cache entry (benchmarks start cold with it); blocks in use are untouched."""
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        self.summary.clear()

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def usage(self) -> float:
        return 1.0 - self.free_queue.num_free / self.total_blocks

    # -- invariants -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the module invariant; with no live tables, every block must be free."""
        refs = [0] * self.total_blocks
        self.count_table_refs(refs)
        self.check_pool(refs, bool(self.block_tables))

    def count_table_refs(self, refs: list[int]) -> None:
        """Check this manager's tables and add one to ``refs[b]`` per table naming block ``b``."""
        for request_id, table in self.block_tables.items():
            skipped = self.num_skipped_blocks.get(request_id, 0)
            assert all(b == self.null_block for b in table[:skipped]), f"{request_id}: a skipped block is not null"
            assert self.null_block not in table[skipped:], f"{request_id}: a null block inside its window"
            for block_id in table:
                if block_id != self.null_block:
                    refs[block_id] += 1
        assert set(self.num_skipped_blocks) <= set(self.block_tables), "skipped counts of a request with no table"
        for request_id, n in self.num_cached_blocks.items():
            assert n <= len(self.block_tables.get(request_id, ())), f"{request_id}: registered past its table"

    def check_pool(self, refs: list[int], live: bool) -> None:
        """Check the pool against ``refs`` (every table's references; ``live``: some table exists)."""
        free_ids = self.free_queue.block_ids()
        assert len(free_ids) == self.free_queue.num_free == len(set(free_ids))
        free_set = set(free_ids)
        for block in self.blocks:
            assert block.ref_cnt == refs[block.block_id], f"block {block.block_id} ref count drift"
            in_free = block.block_id in free_set
            assert in_free == block.in_free_queue
            assert in_free == (block.ref_cnt == 0), f"block {block.block_id} both free and in use"
        if not live:
            assert self.free_queue.num_free == self.total_blocks, "blocks leaked with no live request"
        # Prefix cache: the map and the blocks' hashes agree, one block per hash.
        hashed = [b for b in self.blocks if b.block_hash is not None]
        assert len(hashed) == len(self.cached_blocks), "cache map and block hashes disagree"
        for block in hashed:
            assert self.cached_blocks.get(block.block_hash) is block  # type: ignore[arg-type]
        assert self.summary.counts() == Counter(summary_key(h) for h in self.cached_blocks), "summary and cache disagree"
