"""Stored responses in Redis (`common.protocol.Names.response`): a hash per response with its
``status``, its ``owner`` (the tenant id of the API key that created it, `gateway.http.tenants`:
never the key), the ``response`` object and the chat ``history`` a ``previous_response_id`` turn
continues after.
Every write sets the TTL (`GatewayConfig.response_ttl_s`): nothing is kept forever, and a
response past ``MAX_STORED_RESPONSE_BYTES`` is not kept at all.

A background response is run by the gateway that accepted it, which holds its lease
(`Names.response_lease`, `RESPONSE_LEASE_MS`) while it runs: a response still queued or in
progress whose lease has lapsed belongs to a gateway that died, and reads as "failed". One
created with ``stream: true`` also appends its typed events to a Redis stream
(`Names.response_events`, capped at ``RESPONSE_EVENTS_MAXLEN``, with the response's TTL), which any
gateway replays to the response's owner (`gateway.http.responses_api`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from common.protocol import MAX_STORED_RESPONSE_BYTES, RESPONSE_EVENTS_MAXLEN, Names
from common.transport import Transport

logger = logging.getLogger("conveyor.gateway")

# Write the record unless the response was cancelled meanwhile (a cancel on another gateway).
_SAVE_SCRIPT = """
if ARGV[4] == '1' and redis.call('HGET', KEYS[1], 'status') == 'cancelled' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'owner', ARGV[2], 'response', ARGV[3], 'history', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
return 1
"""
RUNNING = ("queued", "in_progress")
DEADLINE_S = 5.0
_EVENT_FIELD = b"e"


@dataclass(slots=True)
class StoredResponse:
    """A stored response as read back."""

    status: str
    response: dict[str, Any]
    history: list[dict[str, Any]]


class ResponseStore:
    """Reads and writes stored responses (and background leases) through the gateway's transport."""

    def __init__(self, transport: Transport, names: Names, ttl_ms: int) -> None:
        self.transport = transport
        self.names = names
        self.ttl_ms = ttl_ms

    async def save(
        self, response: dict[str, Any], history: list[dict[str, Any]], owner: str, unless_cancelled: bool = False
    ) -> bool:
        """Store ``response`` (replacing its earlier state); False if not stored (too large, or
        cancelled meanwhile with ``unless_cancelled``)."""
        body, past = json.dumps(response, ensure_ascii=False), json.dumps(history, ensure_ascii=False)
        if len(body) + len(past) > MAX_STORED_RESPONSE_BYTES:
            logger.warning("response %s is over %d bytes: not stored", response["id"], MAX_STORED_RESPONSE_BYTES)
            return False
        key = self.names.response(response["id"])
        args = (response["status"], owner, body, "1" if unless_cancelled else "0", past, self.ttl_ms)
        r = self.transport.redis
        return bool(await self.transport.call(r.eval, _SAVE_SCRIPT, 1, key, *args, deadline_s=DEADLINE_S))

    async def load(self, response_id: str, owner: str) -> StoredResponse | None:
        """The stored response, if there is one that ``owner`` owns (another's reads as none).
        A background response whose gateway died reads as failed (and is stored so)."""
        r = self.transport.redis
        fields = await self.transport.call(r.hgetall, self.names.response(response_id), deadline_s=DEADLINE_S)
        if not fields or fields.get(b"owner", b"").decode() != owner:
            return None
        stored = StoredResponse(fields[b"status"].decode(), json.loads(fields[b"response"]), json.loads(fields[b"history"]))
        if stored.status in RUNNING and not await self.transport.call(
            r.exists, self.names.response_lease(response_id), deadline_s=DEADLINE_S
        ):
            again = await self.transport.call(r.hget, self.names.response(response_id), "status", deadline_s=DEADLINE_S)
            if again is not None and again.decode() in RUNNING:  # (not one that ended as the lease went)
                error = {"code": "server_error", "message": "the gateway running this background response stopped"}
                stored.response = {**stored.response, "status": "failed", "error": error}
                stored.status = "failed"
                await self.save(stored.response, stored.history, owner, unless_cancelled=True)
        return stored

    async def delete(self, response_id: str, owner: str) -> bool:
        """Delete a response ``owner`` owns; False if there is none."""
        if await self.load(response_id, owner) is None:
            return False
        r = self.transport.redis
        await self.transport.call(
            r.delete,
            self.names.response(response_id),
            self.names.response_lease(response_id),
            self.names.response_events(response_id),
            deadline_s=DEADLINE_S,
        )
        return True

    async def hold(self, response_id: str, lease_ms: int) -> str | None:
        """Take or refresh a background response's lease; its stored status (None if gone)."""
        r = self.transport.redis
        await self.transport.call(r.set, self.names.response_lease(response_id), "1", px=lease_ms, deadline_s=DEADLINE_S)
        status = await self.transport.call(r.hget, self.names.response(response_id), "status", deadline_s=DEADLINE_S)
        return status.decode() if status is not None else None

    async def append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        """Append a background response's typed events to its event stream (one round trip)."""
        if not events:
            return
        key = self.names.response_events(response_id)

        def attempt() -> Any:  # a new pipeline per try
            pipe: Any = self.transport.redis.pipeline(transaction=False)
            for event in events:
                data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
                pipe.xadd(key, {_EVENT_FIELD: data}, maxlen=RESPONSE_EVENTS_MAXLEN, approximate=False)
            pipe.pexpire(key, self.ttl_ms)
            return pipe.execute()

        await self.transport.call(attempt, deadline_s=DEADLINE_S)

    async def has_events(self, response_id: str) -> bool:
        r = self.transport.redis
        return bool(await self.transport.call(r.exists, self.names.response_events(response_id), deadline_s=DEADLINE_S))

    async def read_events(self, response_id: str, after: bytes, block_ms: int | None) -> list[tuple[bytes, dict[str, Any]]]:
        """The events after stream entry ``after`` (``b"0-0"``: all), waiting up to ``block_ms``
        for one (None: not at all)."""
        r = self.transport.redis
        key = self.names.response_events(response_id)
        reply = await self.transport.call(r.xread, {key: after}, count=1024, block=block_ms, deadline_s=DEADLINE_S)
        return [(entry_id, json.loads(fields[_EVENT_FIELD])) for _, entries in reply or [] for entry_id, fields in entries]

    async def release(self, response_id: str) -> None:
        r = self.transport.redis
        await self.transport.call(r.delete, self.names.response_lease(response_id), deadline_s=DEADLINE_S)
