"""Which engine a new request goes to, and when a request must leave the engine it is on.

Three policies (`ROUTING_POLICIES`, a gateway's ``--routing``):
- ``cache_aware`` (the default), Dynamo's KV router cost: each engine costs ``overlap_weight`` x
  the prompt's blocks it would have to compute (those past its cached prefix, `PrefixIndex`)
  plus its active blocks (`active_blocks`); the cheapest wins.
- ``first_block``: rendezvous hashing of the prompt's first KV block, bounded by load
  (`AFFINITY_SLACK`).
- ``least_loaded``: the least loaded, whatever the prompt.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Callable, Sequence

from common.protocol import EngineStatus

ROUTING_POLICIES = ("cache_aware", "first_block", "least_loaded")
DEFAULT_ROUTING = "cache_aware"
# A block to prefill weighs four blocks in use: blocks in use here count every block a running
# request holds (Dynamo's weight 1 counts decode blocks), and on bench.routing's chat workload
# weights 4-8 reach 0.93 of one big engine's hit rate where 1 reaches under half (docs/performance.md).
DEFAULT_OVERLAP_WEIGHT = 4.0

# How much more load (`EngineStatus.load` units: a running request 1, a waiting one 4) a prompt's
# affinity engine may carry than the least-loaded engine before the prompt goes to the latter: a
# cached prefix saves its prefill, but not the wait behind a long queue.
AFFINITY_SLACK = 8


def active_blocks(engine: EngineStatus, sent_blocks: int, prompt_blocks: int) -> float:
    """An engine's KV blocks in use, as a gateway can tell: those its running requests hold, its
    waiting requests' at the running ones' mean (their prompts are not in the status), and the
    prompt blocks this gateway sent it since its status was read (``sent_blocks``)."""
    used = engine.num_blocks - engine.num_free_blocks
    per_request = used / engine.num_running if engine.num_running else prompt_blocks
    return used + engine.num_waiting * per_request + sent_blocks


def routing_cost(prompt_blocks: int, overlap: int, active: float, overlap_weight: float) -> float:
    """Dynamo's KV router cost of one engine: the blocks it must prefill, weighted, plus its active blocks."""
    return overlap_weight * (prompt_blocks - overlap) + active


def choose_engine(
    engines: list[EngineStatus],
    load_of: Callable[[EngineStatus], int],
    prompt_token_ids: Sequence[int] = (),
    *,
    policy: str = DEFAULT_ROUTING,
    overlap_of: Callable[[EngineStatus], int] | None = None,
    sent_blocks_of: Callable[[EngineStatus], int] | None = None,
    overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
) -> EngineStatus | None:
    """Where a request should run, among live engines (those with an executor bound, if any), by
    ``policy`` (see the module doc). ``load_of``: an engine's load as this gateway sees it;
    ``overlap_of``: how many of the prompt's leading blocks it holds; ``sent_blocks_of``: prompt
    blocks this gateway sent it since its status was read (``cache_aware`` only).

    ``first_block`` picks the prompt's *affinity* engine unless it is busier than the least-loaded
    one by more than `AFFINITY_SLACK`: prompts that share a first block (a system prompt, a
    conversation's history) meet on one engine, whichever gateway routes them, and an engine's
    death moves only its own share of prefixes.
    """
    bound = [e for e in engines if e.executor_id]
    candidates = bound or engines
    if not candidates:
        return None
    # Ties broken at random: gateways that see the same loads must not all pick the same engine.
    least = min(candidates, key=lambda e: (load_of(e), -e.num_free_blocks, random.random()))
    block = least.block_size
    if policy == "least_loaded" or block < 1 or len(prompt_token_ids) < block or len(candidates) == 1:
        return least
    if policy == "cache_aware":
        blocks = len(prompt_token_ids) // block

        def cost(e: EngineStatus) -> float:
            overlap = overlap_of(e) if overlap_of is not None else 0
            active = active_blocks(e, sent_blocks_of(e) if sent_blocks_of is not None else 0, blocks)
            return routing_cost(blocks, overlap, active, overlap_weight)

        return min(candidates, key=lambda e: (cost(e), load_of(e), random.random()))
    first_block = array("i", prompt_token_ids[:block]).tobytes()
    preferred = max(candidates, key=lambda e: hashlib.blake2b(first_block + e.scheduler_id.encode(), digest_size=8).digest())
    return preferred if load_of(preferred) <= load_of(least) + AFFINITY_SLACK else least


def reason_to_leave(
    scheduler_id: str,
    incarnation: str,
    engines: dict[str, EngineStatus],
    unbound_for_s: float,
    *,
    gone: bool,
    stranded_after_s: float,
) -> str | None:
    """Why a request routed to ``scheduler_id`` (in its ``incarnation``) must be migrated, or None.

    Its engine is gone (``gone``: no status, past any settling time), restarted, or has had no
    executor for ``stranded_after_s`` (``unbound_for_s`` so far) while another engine has one: it
    would wait for a new executor up to the recovery timeout, and an executor's restart and model
    load can take as long."""
    status = engines.get(scheduler_id)
    if status is None:
        return f"engine {scheduler_id} is gone" if gone else None
    if status.incarnation != incarnation:
        return f"engine {scheduler_id} restarted"
    if unbound_for_s > stranded_after_s and any(e.executor_id for sid, e in engines.items() if sid != scheduler_id):
        return f"engine {scheduler_id} has had no executor for {unbound_for_s:.0f}s"
    return None
