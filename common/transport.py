"""Redis-stream transport: send, read, pipelined exchanges, heartbeats, dead letters.

`TransportCore` holds all that does no I/O; two faces only make the Redis calls: `Transport` on
``redis.asyncio`` for the gateway (an HTTP server on an event loop), and `SyncTransport` on plain
redis-py for the scheduler and executor, whose hot path is one step at a time: running it inline
with blocking calls avoids an event-loop and thread hand-off per message (each a wake-up on a busy
CPU). `common.heartbeat.Heartbeat` beats on its own thread, so liveness does not depend on how long a step or an
event-loop turn takes.

Why the settings below:
- The socket timeout is set above the longest ``BLOCK`` any caller uses (redis-py's default of
  5 s would turn a long blocking read into a TimeoutError after internal retries).
- Connection errors are retried with exponential backoff (capped), forever for readers and
  writers of long-lived services; a Redis restart costs a pause, not a crashed service.
- A key's TTL (`Outgoing.ttl_ms`) is renewed at most once per `TTL_RENEW_FRACTION` of it, to that
  TTL plus the fraction: the key still lives at least its TTL past every write, for one PEXPIRE
  per fraction of the TTL instead of one per write (a streamed token's journal entry would carry
  one). What was renewed is forgotten on any retried error and when Redis's ``run_id`` changes,
  so a key that Redis lost and a write recreated gets its TTL with that write's retry or the next.
- A message that fails `protocol.decode` is logged, copied to the dead-letter stream with the
  reason, and skipped: one bad producer cannot wedge a consumer. What counts as transient, and
  the retry policy: `common.redis_errors`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar, cast

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster as cluster
from redis.commands.core import AsyncScript
from redis.exceptions import RedisClusterException

from common.append_script import APPEND_SCRIPT, script_arguments
from common.protocol import (
    DEAD_LETTER_MAXLEN,
    DEAD_LETTER_TTL_MS,
    ENTRY_FIELD,
    MAX_MESSAGE_BYTES,
    Names,
    ProtocolError,
    decode,
    encode,
)
from common.redis_errors import RETRIED_ERRORS, TRANSIENT_ERRORS, Backoff, as_transient, refuses_writes
from common.redis_url import async_client, sync_client

logger = logging.getLogger(__name__)

MAX_BLOCK_MS = 2000  # the longest BLOCK any reader uses; socket timeout is set above it
FIRST_ENTRY_ID = "0-1"  # the lowest stream entry id: `Transport.create_stream`
# Trimming is housekeeping a later trim redoes: it never holds up the loop that does it for long
# (a Redis refusing writes refuses XTRIM too).
TRIM_DEADLINE_S = 2.0
CLIENT_OPTIONS: dict[str, Any] = dict(
    socket_timeout=MAX_BLOCK_MS / 1000 + 5.0,
    socket_connect_timeout=5.0,
    socket_keepalive=True,
    health_check_interval=30,
    max_connections=64,
)
# A call that finds every pooled connection busy waits this long for one (a blocking pool): the
# default pool would fail it at once with "Too many connections", a burst of requests would
# retry with backoff, and every stream would stall.
POOL_WAIT_S = 20.0
TTL_RENEW_FRACTION = 8
RENEWALS_PRUNE_SIZE = 1024  # keys remembered as renewed before the lapsed ones are dropped

Received = tuple[str, bytes, Any]  # (stream, entry id, message) of one entry read
Rejected = tuple[str, bytes, dict[bytes, bytes], str]  # (stream, entry id, entry, reason): one to dead-letter
Cursors = dict[str, bytes | str]  # stream -> id of the last entry taken (XREAD's "after")
Client = TypeVar("Client", redis.Redis, aioredis.Redis)


class Outgoing(NamedTuple):
    """One XADD of a pipelined exchange: trimmed to about ``maxlen`` entries, and the stream's
    TTL refreshed to ``ttl_ms`` (streams whose reader may vanish, such as a gateway's outputs)."""

    stream: str
    data: bytes
    maxlen: int | None = None
    ttl_ms: int | None = None


def is_cluster(client: Any) -> bool:
    """Whether ``client`` is a Redis Cluster client (sync or asyncio)."""
    return isinstance(client, (cluster.RedisCluster, aiocluster.RedisCluster))


def _info_target(client: Any) -> dict[str, Any]:
    """Where ``INFO`` goes: every master of a cluster (those hold the data), else the one server."""
    return {"target_nodes": cluster.RedisCluster.PRIMARIES} if is_cluster(client) else {}


def renewed_ttl_ms(ttl_ms: int) -> int:
    """The TTL a renewal gives a key whose writes ask for ``ttl_ms`` (see the module docstring)."""
    return ttl_ms + ttl_ms // TTL_RENEW_FRACTION


def parse_run_id(info: dict[str, Any]) -> str:
    """The ``run_id`` in a reply to ``INFO server``; "" if it has none. A cluster's reply (one per
    master, by node) gives a digest of its masters' run_ids: it changes when any master restarts or
    a replica takes over from one, as a single server's run_id does when it restarts."""
    if "run_id" in info or not info or not all(isinstance(v, dict) for v in info.values()):
        return str(info.get("run_id", ""))
    run_ids = sorted(str(v.get("run_id", "")) for v in info.values())
    return hashlib.sha1(",".join(run_ids).encode()).hexdigest()


def server_run_id(client: redis.Redis) -> str:
    """The server's ``run_id`` (`parse_run_id`): it changes when Redis restarts (or fails over), which
    is how services learn that what they wrote may be gone. "" where the server has no INFO (fakeredis)."""
    try:
        return parse_run_id(client.info("server", **_info_target(client)))
    except redis.ResponseError:
        return ""


def by_slot(client: Any, sends: list[Outgoing]) -> list[list[Outgoing]]:
    """``sends`` in groups that one script call may take: all of them on a single Redis, one group
    per hash slot (in order within each) on a cluster, where a script's keys must share a slot."""
    if not is_cluster(client) or len(sends) < 2:
        return [sends]
    groups: dict[int, list[Outgoing]] = {}
    for out in sends:
        groups.setdefault(client.keyslot(out.stream), []).append(out)
    return list(groups.values())


class TransportCore(Generic[Client]):
    """What both transports share: a face adds only the Redis calls and when to make them. Command
    helpers return the keyword arguments of one redis-py call (a dead letter: the call that sends
    its two commands, for the face to make), so a command is spelled once whether a face sends it
    alone, awaits it, or a pipeline queues it."""

    def __init__(self, url: str, names: Names, *, max_message_bytes: int = MAX_MESSAGE_BYTES, owner: str = "?") -> None:
        self.url = url
        self.names = names
        self.max_message_bytes = max_message_bytes
        self.owner = owner
        self.num_dead_letters = 0
        self.redis: Client = self._connect(url)
        self._renew_at: dict[str, float] = {}  # key -> when (monotonic) its TTL is next renewed
        self._prune_at = RENEWALS_PRUNE_SIZE
        self._run_id: str | None = None

    def _connect(self, url: str) -> Client:
        raise NotImplementedError  # each face makes its own client, sync or async

    # -- TTL renewals --------------------------------------------------------------------------
    def ttls_due(self, sends: list[Outgoing]) -> list[int | None]:
        """The PEXPIRE each of ``sends`` carries: the renewed TTL where its key is due for one, else
        None (no TTL asked for, renewed recently, or earlier in ``sends``). Counts them as done: a
        call that fails forgets every renewal (`forget_renewals`), so its retry renews again."""
        now = time.monotonic()
        out: list[int | None] = []
        for send in sends:
            if send.ttl_ms is None or self._renew_at.get(send.stream, 0.0) > now:
                out.append(None)
                continue
            self._renew_at[send.stream] = now + send.ttl_ms / 1000 / TTL_RENEW_FRACTION
            out.append(renewed_ttl_ms(send.ttl_ms))
        if len(self._renew_at) > self._prune_at:
            for key, due in list(self._renew_at.items()):  # a copy: other threads may renew meanwhile
                if due <= now:
                    self._renew_at.pop(key, None)
            self._prune_at = max(RENEWALS_PRUNE_SIZE, 2 * len(self._renew_at))
        return out

    def forget_renewals(self) -> None:
        """Renew every key's TTL at its next write: Redis may have lost them (an error, a restart)."""
        self._renew_at.clear()

    def _seen_run_id(self, run_id: str) -> str:
        """``run_id`` read from the server; a new one (Redis restarted, or failed over) forgets renewals."""
        if run_id != self._run_id:
            self.forget_renewals()
            self._run_id = run_id
        return run_id

    # -- messages ------------------------------------------------------------------------------
    def encode(self, msg: Any) -> bytes:
        """``msg`` as the bytes of one stream entry (raises if over ``max_message_bytes``)."""
        return encode(msg, self.max_message_bytes)

    def decode_value(self, key: str, data: bytes, expected: tuple[type, ...] | None = None) -> Any:
        """The message in a key's value, or None if malformed (logged)."""
        try:
            return decode(data, expected, self.max_message_bytes)
        except ProtocolError as exc:
            logger.error("%s: malformed value at %s: %s", self.owner, key, exc)
            return None

    def _decode_entry(self, entry: dict[bytes, bytes], expected: tuple[type, ...] | None) -> Any:
        """The message of one stream entry; raises `ProtocolError` if it is not a valid one."""
        data = entry.get(ENTRY_FIELD)
        if data is None:
            raise ProtocolError(f"entry has no {ENTRY_FIELD.decode()!r} field (fields: {sorted(entry)})")
        return decode(data, expected, self.max_message_bytes)

    def _collect(self, reply: Any, cursors: Cursors, expected: tuple[type, ...] | None) -> tuple[list[Received], list[Rejected]]:
        """An XREAD reply as its valid messages and its rejected entries; ``cursors`` move past both,
        so a bad entry is never read again."""
        received: list[Received] = []
        rejected: list[Rejected] = []
        for stream_name, entries in reply or []:
            stream = stream_name.decode() if isinstance(stream_name, bytes) else stream_name
            for entry_id, entry in entries:
                cursors[stream] = entry_id
                try:
                    received.append((stream, entry_id, self._decode_entry(entry, expected)))
                except ProtocolError as exc:
                    rejected.append((stream, entry_id, entry, str(exc)))
        return received, rejected

    def _dead_letter(self, stream: str, entry_id: bytes, entry: dict[bytes, bytes], reason: str) -> Callable[[], Any]:
        """Count and log a rejected entry; returns the call (a new pipeline per try) that keeps a
        copy (truncated) on the dead-letter stream and refreshes the stream's TTL."""
        self.num_dead_letters += 1
        logger.error("%s: rejected entry %s on %s: %s", self.owner, entry_id, stream, reason)
        record: dict[Any, Any] = {"stream": stream, "id": entry_id, "reason": reason, "by": self.owner}
        for key, value in list(entry.items())[:8]:
            record[b"raw:" + key[:64]] = value[:4096]

        def write() -> Any:
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(self.names.dead_letter, record, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
            pipe.pexpire(self.names.dead_letter, DEAD_LETTER_TTL_MS)
            return pipe.execute()

        return write

    # -- commands ------------------------------------------------------------------------------
    @staticmethod
    def _xadd(stream: str, data: bytes, maxlen: int | None) -> dict[str, Any]:
        return dict(name=stream, fields={ENTRY_FIELD: data}, maxlen=maxlen, approximate=True)

    @staticmethod
    def _xread(cursors: Cursors, count: int, block_ms: int | None) -> dict[str, Any]:
        assert block_ms is None or block_ms <= MAX_BLOCK_MS
        return dict(streams=dict(cursors), count=count, block=block_ms)  # a copy: cursors move on

    @staticmethod
    def _xtrim_through(stream: str, entry_id: bytes | str) -> dict[str, Any]:
        return dict(name=stream, minid=entry_id, approximate=False)

    @staticmethod
    def _last_id_of(reply: Any) -> bytes:
        """The newest id in a reply to ``XREVRANGE stream COUNT 1``; "0-0" for an empty stream."""
        return reply[0][0] if reply else b"0-0"

    def _pipeline(self, sends: list[Outgoing], trim: Cursors | None, read: dict[str, Any] | None, client: Any = None) -> Any:
        """A non-transactional pipeline (on ``client``, else this transport's): the XADDs (and
        PEXPIREs) of ``sends``, XTRIMs of ``trim`` streams before their ids, then one XREAD with
        ``read`` arguments (see `_xread`)."""
        pipe: Any = (client or self.redis).pipeline(transaction=False)  # queues commands, even on the async client
        for out, ttl_ms in zip(sends, self.ttls_due(sends), strict=True):
            pipe.xadd(**self._xadd(out.stream, out.data, out.maxlen))
            if ttl_ms is not None:
                pipe.pexpire(out.stream, ttl_ms)
        for stream, entry_id in (trim or {}).items():
            pipe.xtrim(**self._xtrim_through(stream, entry_id))
        if read is not None:
            pipe.xread(**read)
        return pipe


class Transport(TransportCore[aioredis.Redis]):
    """One process's connection to the shared Redis, with protocol encode/decode built in (async)."""

    def __init__(self, url: str, names: Names, *, max_message_bytes: int = MAX_MESSAGE_BYTES, owner: str = "?") -> None:
        super().__init__(url, names, max_message_bytes=max_message_bytes, owner=owner)
        self._append_script: AsyncScript | bool | None = None  # None: not tried yet; False: refused
        self._nx_refused = False  # the server is older than Redis 7 (`create_stream`), said once

    def _connect(self, url: str) -> aioredis.Redis:
        return async_client(url, pool_timeout_s=POOL_WAIT_S, **CLIENT_OPTIONS)

    async def close(self) -> None:
        await self.redis.aclose()

    async def call(self, fn: Any, *args: Any, deadline_s: float | None = None, **kwargs: Any) -> Any:
        """Run ``await fn(*args, **kwargs)``, retrying transient errors with capped backoff: forever for
        ``deadline_s`` None (service loops), else until that many seconds have passed (fail-fast paths)."""
        backoff = Backoff(self.owner, deadline_s)
        while True:
            try:
                return await fn(*args, **kwargs)
            except RETRIED_ERRORS as exc:
                self.forget_renewals()
                await asyncio.sleep(backoff.wait_s(exc))

    async def ping(self, deadline_s: float | None = None) -> None:
        await self.call(self.redis.ping, deadline_s=deadline_s)

    async def send(self, stream: str, msg: Any, *, maxlen: int | None = None, deadline_s: float | None = None) -> bytes:
        """Append one message to ``stream`` (optionally trimmed to about ``maxlen`` entries)."""
        return await self.send_raw(stream, self.encode(msg), maxlen=maxlen, deadline_s=deadline_s)

    async def send_raw(self, stream: str, data: bytes, *, maxlen: int | None = None, deadline_s: float | None = None) -> bytes:
        """Append an already encoded message to ``stream``."""
        return await self.call(self.redis.xadd, **self._xadd(stream, data, maxlen), deadline_s=deadline_s)

    async def send_many(self, sends: list[Outgoing], deadline_s: float | None = None) -> None:
        """XADD every message (and refresh TTLs) in one round trip: one script call where the
        server runs scripts (`common.append_script`), else a pipeline. On a cluster, a script call
        per hash slot with several appends, and one pipeline for the slots with one each (a
        cluster pipeline takes one round trip per master, where a call per slot would take a
        connection and a round trip per journal), all at once; every one of them has ended (sent
        or failed) before any error is raised."""
        groups = by_slot(self.redis, sends)
        if len(groups) == 1:
            return await self._send_slot(sends, deadline_s)
        singles = [group[0] for group in groups if len(group) == 1]
        calls = [self._send_slot(group, deadline_s) for group in groups if len(group) > 1]
        if singles:
            calls.append(self._send_pipelined(singles, deadline_s))
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _send_slot(self, sends: list[Outgoing], deadline_s: float | None) -> None:
        """`send_many` of appends whose streams share a slot (any, on a single Redis)."""
        if len(sends) > 1 and self._append_script is not False:
            if self._append_script is None:  # first use: can this server run it?
                try:
                    await self.call(self.redis.script_load, APPEND_SCRIPT, deadline_s=deadline_s)
                    self._append_script = self.redis.register_script(APPEND_SCRIPT)
                except redis.ResponseError as exc:
                    logger.info("%s: Redis runs no scripts (%s); appends go pipelined", self.owner, exc)
                    self._append_script = False
            if isinstance(script := self._append_script, AsyncScript):  # reloaded by redis-py if the server lost it

                def run() -> Any:  # the arguments per try: a retry renews the TTLs again
                    keys, args = script_arguments(sends, self.ttls_due(sends))
                    return script(keys=keys, args=args)

                try:
                    await self.call(run, deadline_s=deadline_s)
                    return
                except redis.ResponseError as exc:  # e.g. a stand-in without Lua's cmsgpack: it fails before any append
                    logger.warning("%s: the append script failed (%s); appends go pipelined", self.owner, exc)
                    self._append_script = False
        await self._send_pipelined(sends, deadline_s)

    async def _send_pipelined(self, sends: list[Outgoing], deadline_s: float | None) -> None:
        """`send_many` as one pipeline (on a cluster, one round trip per master it touches)."""
        if sends:  # a new pipeline per try: a failed execute() leaves its own empty
            await self.call(lambda: self._pipeline(sends, None, None).execute(), deadline_s=deadline_s)

    async def create_stream(self, first: Outgoing, deadline_s: float | None = None) -> bool:
        """Create ``first.stream`` with ``first`` as its first entry (and its TTL), unless the stream
        exists: False then. Atomic, whoever else tries: the entry gets the lowest id there is
        (`FIRST_ENTRY_ID`), which XADD refuses once a stream has or had any entry."""

        def attempt() -> Any:
            pipe: Any = self.redis.pipeline(transaction=False)
            pipe.xadd(**self._xadd(first.stream, first.data, first.maxlen), id=FIRST_ENTRY_ID)
            if first.ttl_ms is not None:
                # In the same round trip, so that a created stream never lacks its TTL; NX (only a
                # key without one): a refused claim must not extend the stream it lost to, or a client
                # retrying an id whose owner died would keep that id locked for good.
                pipe.pexpire(first.stream, first.ttl_ms, nx=True)
            return pipe.execute(raise_on_error=False)

        replies = await self.call(attempt, deadline_s=deadline_s)
        if refuses_writes(replies[0]):  # not "taken": Redis refuses writes for now (a 503, not a 409)
            raise as_transient(replies[0])
        created = not isinstance(replies[0], redis.ResponseError)
        if created and first.ttl_ms is not None and isinstance(replies[1], redis.ResponseError):
            # A server older than Redis 7 refuses NX: the stream just created gets its TTL now.
            if not self._nx_refused:
                self._nx_refused = True
                logger.warning("Redis refused PEXPIRE NX (%s): with Redis < 7 a claimed stream costs a second call", replies[1])
            await self.call(self.redis.pexpire, first.stream, first.ttl_ms, deadline_s=deadline_s)
        return created

    async def trim_through(self, stream: str, entry_id: bytes | str, deadline_s: float | None = TRIM_DEADLINE_S) -> None:
        """Delete the entries of ``stream`` before ``entry_id`` (its single reader has taken them)."""
        await self.call(self.redis.xtrim, **self._xtrim_through(stream, entry_id), deadline_s=deadline_s)

    async def refresh_ttl(self, keys: list[str], ttl_ms: int, deadline_s: float | None = None) -> None:
        """Give each of ``keys`` that exists ``ttl_ms`` to live from now (one round trip)."""

        def attempt() -> Any:  # a new pipeline per try
            pipe: Any = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.pexpire(key, ttl_ms)
            return pipe.execute()

        await self.call(attempt, deadline_s=deadline_s)

    async def run_id(self, deadline_s: float | None = None) -> str:
        """See `server_run_id`."""
        try:
            info = await self.call(self.redis.info, "server", **_info_target(self.redis), deadline_s=deadline_s)
            return self._seen_run_id(parse_run_id(info))
        except redis.ResponseError:
            return ""

    async def get_many(self, keys: list[str], deadline_s: float | None = None) -> list[bytes | None]:
        """The values of ``keys`` (None for a missing one), in one round trip per server: MGET, or
        on a cluster one per slot, since keys of different owners lie in different slots."""
        if not keys:
            return []
        mget = self.redis.mget_nonatomic if is_cluster(self.redis) else self.redis.mget  # type: ignore[attr-defined]
        return list(await self.call(mget, keys, deadline_s=deadline_s))

    async def read(
        self, cursors: Cursors, *, count: int = 256, block_ms: int | None = 1000, expected: tuple[type, ...] | None = None
    ) -> list[Received]:
        """XREAD after each cursor (advanced in place): ``(stream, entry_id, message)``; malformed
        entries are dead-lettered."""
        reply = await self.call(self.redis.xread, **self._xread(cursors, count, block_ms))
        received, rejected = self._collect(reply, cursors, expected)
        for bad in rejected:
            await self.dead_letter(*bad)
        return received

    async def last_id(self, stream: str) -> bytes:
        """The id of the newest entry of ``stream`` ("0-0" if empty): a cursor for new entries."""
        return self._last_id_of(await self.call(self.redis.xrevrange, stream, count=1))

    async def dead_letter(self, stream: str, entry_id: bytes, entry: dict[bytes, bytes], reason: str) -> None:
        """Log a rejected entry and keep a copy (truncated) on the dead-letter stream."""
        try:
            await self.call(self._dead_letter(stream, entry_id, entry, reason), deadline_s=5)
        except TRANSIENT_ERRORS:
            logger.exception("could not write the dead letter")

    async def beat(self, kind: str, process_id: str, ttl_ms: int) -> None:
        """Refresh this process's heartbeat key."""
        await self.call(self.redis.set, self.names.heartbeat(kind, process_id), str(time.time()), px=ttl_ms)

    async def alive(self, kind: str, process_id: str, deadline_s: float | None = None) -> bool:
        """Whether that process's heartbeat key exists (it beat within its TTL)."""
        return bool(await self.call(self.redis.exists, self.names.heartbeat(kind, process_id), deadline_s=deadline_s))


class SyncTransport(TransportCore[redis.Redis]):
    """`Transport` with blocking calls, for loops that run one step at a time (scheduler, executor).

    Thread-safe: redis-py's pool gives every concurrent call its own connection, so reader threads
    can block on their streams while the engine thread runs steps.
    """

    def _connect(self, url: str) -> redis.Redis:
        return sync_client(url, pool_timeout_s=POOL_WAIT_S, **CLIENT_OPTIONS)

    def close(self) -> None:
        self.redis.close()

    def call(self, fn: Any, *args: Any, deadline_s: float | None = None, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with the retry policy of `Transport.call`."""
        backoff = Backoff(self.owner, deadline_s)
        while True:
            try:
                return fn(*args, **kwargs)
            except RETRIED_ERRORS as exc:
                self.forget_renewals()
                time.sleep(backoff.wait_s(exc))

    def ping(self, deadline_s: float | None = None) -> None:
        self.call(self.redis.ping, deadline_s=deadline_s)

    def exchange(
        self,
        sends: list[Outgoing],
        cursors: Cursors | None = None,
        *,
        count: int = 256,
        block_ms: int | None = None,
        expected: tuple[type, ...] | None = None,
        deadline_s: float | None = None,
        trim: Cursors | None = None,
    ) -> list[Received]:
        """XADD every message, trim ``trim`` streams before their ids, then XREAD ``cursors``: one
        pipelined round trip.

        A transient error retries the whole exchange, so a message may be appended twice; every
        reader tolerates that (steps and results carry a step number, outputs a token index).
        """
        read = self._xread(cursors, count, block_ms) if cursors else None
        if not sends and not cursors and not trim:
            return []
        # A new pipeline per try: a failed execute() leaves its own empty.
        replies = self.call(lambda: self._pipeline(sends, trim, read).execute(), deadline_s=deadline_s)
        if not cursors:
            return []
        received, rejected = self._collect(replies[-1], cursors, expected)
        for bad in rejected:
            self.dead_letter(*bad)
        return received

    def read(
        self, cursors: Cursors, *, count: int = 256, block_ms: int | None = 1000, expected: tuple[type, ...] | None = None
    ) -> list[Received]:
        """XREAD after each cursor (advanced in place); malformed entries are dead-lettered."""
        return self.exchange([], cursors, count=count, block_ms=block_ms, expected=expected)

    def trim_through(self, stream: str, entry_id: bytes | str, deadline_s: float | None = TRIM_DEADLINE_S) -> None:
        """Delete the entries of ``stream`` before ``entry_id`` (its single reader has taken them)."""
        self.call(self.redis.xtrim, **self._xtrim_through(stream, entry_id), deadline_s=deadline_s)

    def run_id(self, deadline_s: float | None = None) -> str:
        """See `server_run_id`."""
        return self._seen_run_id(str(self.call(server_run_id, self.redis, deadline_s=deadline_s)))

    def direct(self, key: str) -> redis.Redis:
        """A plain client of the server that holds ``key``: this transport's own on a single Redis;
        on a cluster, the client of the master that holds ``key``'s slot now (for callers that
        handle connections themselves, `executor.overlap`; after a failure they `reroute`)."""
        if not is_cluster(self.redis):
            return self.redis
        node: Any = self.redis.get_node_from_key(key)  # type: ignore[attr-defined]
        return cast(redis.Redis, node.redis_connection)

    def reroute(self) -> None:
        """After a failure on a `direct` client: re-read a cluster's slot map (a replica may have
        taken over from the master that held the slot). Nothing on a single Redis."""
        if is_cluster(self.redis):
            try:
                self.redis.nodes_manager.initialize()  # type: ignore[attr-defined]
            except (*TRANSIENT_ERRORS, RedisClusterException) as exc:  # no node answers yet: the next failure retries
                logger.warning("%s: could not re-read the cluster's slot map: %s", self.owner, exc)

    def last_id(self, stream: str) -> bytes:
        """The id of the newest entry of ``stream`` ("0-0" if empty): a cursor for new entries."""
        return self._last_id_of(self.call(self.redis.xrevrange, stream, count=1))

    def dead_letter(self, stream: str, entry_id: bytes, entry: dict[bytes, bytes], reason: str) -> None:
        """Log a rejected entry and keep a copy (truncated) on the dead-letter stream."""
        try:
            self.call(self._dead_letter(stream, entry_id, entry, reason), deadline_s=5)
        except TRANSIENT_ERRORS:
            logger.exception("could not write the dead letter")

    def alive(self, kind: str, process_id: str, deadline_s: float | None = None) -> bool:
        """Whether that process's heartbeat key exists (it beat within its TTL)."""
        return bool(self.call(self.redis.exists, self.names.heartbeat(kind, process_id), deadline_s=deadline_s))
