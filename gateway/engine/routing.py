"""Which engine a new request goes to (prompt affinity by rendezvous hashing, bounded by load),
and when a request must leave the engine it is on."""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Callable, Sequence

from common.protocol import EngineStatus

# How much more load (`EngineStatus.load` units: a running request 1, a waiting one 4) a prompt's
# affinity engine may carry than the least-loaded engine before the prompt goes to the latter: a
# cached prefix saves its prefill, but not the wait behind a long queue.
AFFINITY_SLACK = 8


def choose_engine(
    engines: list[EngineStatus], load_of: Callable[[EngineStatus], int], prompt_token_ids: Sequence[int] = ()
) -> EngineStatus | None:
    """Where a request should run: among live engines (those with an executor bound, if any),
    the prompt's *affinity* engine unless it is busier than the least-loaded one by more than
    `AFFINITY_SLACK`, else the least loaded (``load_of``: an engine's load as this gateway sees it).

    The affinity engine is chosen by rendezvous hashing of the prompt's first KV block, so
    prompts that share a prefix (a system prompt, a conversation's history) meet on the engine
    whose prefix cache holds it, whichever gateway routes them, and an engine's death moves only
    its own share of prefixes.
    """
    bound = [e for e in engines if e.executor_id]
    candidates = bound or engines
    if not candidates:
        return None
    # Ties broken at random: gateways that see the same loads must not all pick the same engine.
    least = min(candidates, key=lambda e: (load_of(e), -e.num_free_blocks, random.random()))
    block = least.block_size
    if block < 1 or len(prompt_token_ids) < block or len(candidates) == 1:
        return least
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
