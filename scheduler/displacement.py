"""Priority scheduling's displacement: the running requests a waiting one preempts to get in.

vLLM's priority policy preempts only to give running requests blocks, so a request of high
priority waits behind lower ones while every seat (``max_num_seqs``) or the blocks stay taken (its
issue 40004, a priority inversion). Here a waiting request takes them from running requests of a
strictly lower priority (equals never displace each other, or two could take turns), the lowest
priority and latest arrival first, and only when that is enough: the plan counts the seat and the
blocks the victims would free (a block shared with a request that stays is not freed; one the
request's own prefix-cache hit takes back gives nothing) before anyone is preempted. So no request
is preempted for nothing, and the one it made room for is admitted in the same step (a step is
never left empty by it).
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.kv_groups import KVCacheManager
from scheduler.request import Request
from scheduler.request_queue import admission_key


def plan_room(
    request: Request,
    running: Sequence[Request],
    max_num_seqs: int,
    cache: KVCacheManager,
    num_tokens: int,
    hit_blocks: Sequence[int],
) -> list[Request] | None:
    """The running requests to preempt, in order, so that waiting ``request`` gets a seat and the
    blocks of its first ``num_tokens`` (with its hit ``hit_blocks``): [] when it fits as things
    are, None when even every running request of lower priority would not make room."""
    seats = len(running) - max_num_seqs + 1  # victims a seat takes (none while one is free)
    short = cache.blocks_short(num_tokens, hit_blocks)
    if seats <= 0 and short <= 0:
        return []
    victims: list[Request] = []
    for victim in sorted((r for r in running if r.priority > request.priority), key=admission_key, reverse=True):
        victims.append(victim)
        if len(victims) >= seats and (short <= 0 or cache.blocks_freed_by([v.request_id for v in victims], hit_blocks) >= short):
            return victims
    return None
