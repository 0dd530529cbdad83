"""`PrefixSummary`: what an engine's prefix cache holds, kept up to date as entries come and go,
for gateways to route by (`EngineStatus.cached_prefixes`).

The cache manager tells it of every entry it registers, hits and evicts (O(1) each), so a beat
only copies the most recently used keys out (`encode`), never rehashing or walking the pool.
Keys are `common.prefix_hash.summary_key`s; entries of several KV-cache groups for one block
share a key, counted, so the key stays until the last of them is evicted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from itertools import islice

from common.prefix_hash import summary_key

# The most keys a summary publishes (the most recently used): 4,096 x 8 bytes = 32 KiB in every
# status beat, and a gateway's set of them stays small, however large the pool.
SUMMARY_MAX_KEYS = 4096


class PrefixSummary:
    """The keys of an engine's prefix-cache entries, least recently used first.

    Updated by the engine thread, read by the heartbeat's (`encode`): a lock keeps a beat from
    copying a dict that a step is changing."""

    def __init__(self) -> None:
        self._keys: OrderedDict[bytes, int] = OrderedDict()  # summary key -> entries holding it
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._keys)

    def added(self, cache_key: bytes) -> None:
        """A cache entry was registered: its key is the most recently used."""
        key = summary_key(cache_key)
        with self._lock:
            self._keys[key] = self._keys.get(key, 0) + 1
            self._keys.move_to_end(key)

    def used(self, cache_keys: Iterable[bytes]) -> None:
        """Entries were hit: their keys are the most recently used, the first of them last (a
        prefix's head outlives its tail in the summary, as in the pool, where tails are evicted first)."""
        with self._lock:
            for cache_key in cache_keys:
                key = summary_key(cache_key)
                if key in self._keys:
                    self._keys.move_to_end(key)

    def removed(self, cache_key: bytes) -> None:
        """A cache entry was evicted."""
        key = summary_key(cache_key)
        with self._lock:
            left = self._keys.get(key, 0) - 1
            if left > 0:
                self._keys[key] = left
            else:
                self._keys.pop(key, None)

    def counts(self) -> dict[bytes, int]:
        """Each key and how many cache entries hold it (`CacheManager.check_invariants` checks it)."""
        with self._lock:
            return dict(self._keys)

    def clear(self) -> None:
        """Forget every key (the prefix cache was reset)."""
        with self._lock:
            self._keys.clear()

    def encode(self, max_keys: int = SUMMARY_MAX_KEYS) -> bytes:
        """The ``max_keys`` most recently used keys, packed
        (`common.prefix_hash.SUMMARY_KEY_BYTES` each, newest first; `decode_summary` reads them)."""
        with self._lock:
            return b"".join(islice(reversed(self._keys), max_keys))
