"""`PrefixIndex`: a gateway's view of what each engine's prefix cache holds, for cache-aware routing.

Two sources, per engine: the summary it publishes with its status (`EngineStatus.cached_prefixes`,
re-read every refresh, decoded only when it changed), and what this gateway routed there itself in
the last `ROUTED_PREFIX_TTL_S` (the engine computes a prompt's blocks only after it admits it, and
its summary reaches gateways a beat later: a conversation's next turn, or a burst of prompts
sharing a system prompt, must not scatter meanwhile). Both are bounded.

A prompt's overlap with an engine is the number of its leading blocks up to the deepest block whose
chained hash the engine holds: a chained hash names the whole prefix before it, and the pool evicts
a prefix's tail before its head, so the deepest match measures the cached prefix even where the
summary kept only a prefix's most recently used blocks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from common.prefix_hash import decode_summary, summary_key
from common.protocol import EngineStatus

# How long a routed prompt counts as cached on its engine without the engine saying so: a few
# status beats, and a queued prefill.
ROUTED_PREFIX_TTL_S = 10.0
# The most routed block keys remembered per engine (the oldest go first).
ROUTED_PREFIX_MAX_KEYS = 8192


class PrefixIndex:
    """Per engine, the block keys its prefix cache holds (see the module doc)."""

    def __init__(self, ttl_s: float = ROUTED_PREFIX_TTL_S, max_routed_keys: int = ROUTED_PREFIX_MAX_KEYS) -> None:
        self.ttl_s = ttl_s
        self.max_routed_keys = max_routed_keys
        self._packed: dict[str, bytes] = {}  # by engine: its last summary as published
        self._published: dict[str, frozenset[bytes]] = {}  # by engine: the keys of that summary
        self._routed: dict[str, OrderedDict[bytes, float]] = {}  # by engine: key -> when it expires, oldest first

    def update(self, engines: dict[str, EngineStatus]) -> None:
        """Take the engines' summaries from their statuses; forget engines no longer live."""
        for sid in [s for s in self._packed if s not in engines]:
            del self._packed[sid], self._published[sid]
        for sid in [s for s in self._routed if s not in engines]:
            del self._routed[sid]
        for sid, status in engines.items():
            if self._packed.get(sid) != status.cached_prefixes:
                self._packed[sid] = status.cached_prefixes
                self._published[sid] = decode_summary(status.cached_prefixes)

    def remember(self, scheduler_id: str, hashes: Sequence[bytes], now: float | None = None) -> None:
        """``hashes`` (a prompt's block hashes) were just routed to ``scheduler_id``."""
        if not hashes:
            return
        expires = (time.monotonic() if now is None else now) + self.ttl_s
        routed = self._routed.setdefault(scheduler_id, OrderedDict())
        for h in hashes[-self.max_routed_keys :]:  # the deepest ones: the overlap is measured by them
            key = summary_key(h)
            routed[key] = expires
            routed.move_to_end(key)
        while len(routed) > self.max_routed_keys:
            routed.popitem(last=False)

    def overlap(self, scheduler_id: str, hashes: Sequence[bytes], now: float | None = None) -> int:
        """How many leading blocks of a prompt with the block hashes ``hashes`` ``scheduler_id`` holds."""
        published = self._published.get(scheduler_id, frozenset())
        routed = self._routed.get(scheduler_id)
        t = time.monotonic() if now is None else now
        if routed:
            while routed:  # expired entries leave from the front (all share one TTL)
                key, expires = next(iter(routed.items()))
                if expires > t:
                    break
                del routed[key]
        for i in range(len(hashes) - 1, -1, -1):
            key = summary_key(hashes[i])
            if key in published or (routed is not None and key in routed):
                return i + 1
        return 0

    def num_keys(self, scheduler_id: str) -> tuple[int, int]:
        """How many keys are known of ``scheduler_id``: published, and routed here (not yet expired)."""
        return len(self._published.get(scheduler_id, ())), len(self._routed.get(scheduler_id, ()))
