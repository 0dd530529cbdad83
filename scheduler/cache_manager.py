"""Paged KV block table: a preallocated block pool with an O(1) free-block queue.

Invariant (checked by `check_invariants`): every block is either in the free queue with
``ref_cnt == 0`` or referenced by at least one request's block table with ``ref_cnt`` equal to the
number of tables holding it — never both. Blocks are handed out from the queue's head and
returned to its tail, so the least recently freed block is reused first (what prefix caching's
LRU eviction will need).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class KVBlock:
    """One block of the pool, doubling as a node of the intrusive free list."""

    block_id: int
    ref_cnt: int = 0
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None
    in_free_queue: bool = False


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
    """Owns the block pool and every request's block table (the scheduler's view of KV memory)."""

    def __init__(self, total_blocks: int, block_size: int) -> None:
        assert total_blocks > 0 and block_size > 0
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(total_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.block_tables: dict[str, list[int]] = {}

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
            block.ref_cnt = 1
            out.append(block.block_id)
        return out

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero go back to the free queue.

        Callers pass a table in reverse so a request's tail blocks are reused first: its head
        blocks are the ones a future prefix cache is likeliest to hit.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"block {block_id} freed with ref_cnt 0"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    # -- request level ----------------------------------------------------------------------
    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow ``request_id``'s table to hold ``num_tokens`` tokens, all or nothing."""
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

    def free(self, request_id: str) -> None:
        """Release every block of ``request_id`` (no-op if it holds none)."""
        table = self.block_tables.pop(request_id, None)
        if table:
            self.free_blocks(table[::-1])

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def usage(self) -> float:
        return 1.0 - self.free_queue.num_free / self.total_blocks

    # -- invariants -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the module invariant; with no live tables, every block must be free."""
        refs = [0] * self.total_blocks
        for table in self.block_tables.values():
            for block_id in table:
                refs[block_id] += 1
        free_ids = self.free_queue.block_ids()
        assert len(free_ids) == self.free_queue.num_free == len(set(free_ids))
        free_set = set(free_ids)
        for block in self.blocks:
            assert block.ref_cnt == refs[block.block_id], f"block {block.block_id} ref count drift"
            in_free = block.block_id in free_set
            assert in_free == block.in_free_queue
            assert in_free == (block.ref_cnt == 0), f"block {block.block_id} both free and in use"
        if not self.block_tables:
            assert self.free_queue.num_free == self.total_blocks, "blocks leaked with no live request"
