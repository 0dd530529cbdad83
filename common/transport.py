"""Redis-stream transport: send, read, pipelined exchanges, heartbeats, dead letters.

Two flavours with one behaviour: `Transport` on ``redis.asyncio`` for the gateway (an HTTP
server on an event loop), and `SyncTransport` on plain redis-py for the scheduler and executor,
whose hot path is one step at a time: running it inline with blocking calls avoids an event-loop
and thread hand-off per message (each a wake-up on a busy CPU). `Heartbeat` beats on its own
thread, so liveness does not depend on how long a step or an event-loop turn takes.

Why the settings below:
- The socket timeout is set above the longest ``BLOCK`` any caller uses (redis-py's default of
  5 s would turn a long blocking read into a TimeoutError after internal retries).
- Connection errors are retried with exponential backoff (capped), forever for readers and
  writers of long-lived services; a Redis restart costs a pause, not a crashed service.
- A message that fails `protocol.decode` is logged, copied to the dead-letter stream with the
  reason, and skipped: one bad producer cannot wedge a consumer. Wrong credentials are not
  transient: they raise `RedisAuthFailed` at once with a message that says so.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, NamedTuple

import redis
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.protocol import ENTRY_FIELD, MAX_MESSAGE_BYTES, Names, ProtocolError, decode, encode

logger = logging.getLogger(__name__)

MAX_BLOCK_MS = 2000  # the longest BLOCK any reader uses; socket timeout is set above it
DEAD_LETTER_MAXLEN = 10_000
TRANSIENT_ERRORS = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
CLIENT_OPTIONS: dict[str, Any] = dict(
    socket_timeout=MAX_BLOCK_MS / 1000 + 5.0,
    socket_connect_timeout=5.0,
    socket_keepalive=True,
    health_check_interval=30,
    max_connections=64,
)


class Outgoing(NamedTuple):
    """One XADD of a pipelined exchange: trimmed to about ``maxlen`` entries, and the stream's
    TTL refreshed to ``ttl_ms`` (streams whose reader may vanish, such as a gateway's outputs)."""

    stream: str
    data: bytes
    maxlen: int | None = None
    ttl_ms: int | None = None


class RedisAuthFailed(RuntimeError):
    """Redis refused our credentials: retrying cannot help, so the process says so and stops."""


def _backoff_or_raise(owner: str, exc: BaseException, start: float, delay: float, deadline_s: float | None) -> float:
    if isinstance(exc, AuthenticationError):
        raise RedisAuthFailed(f"{owner}: Redis rejected the credentials in the Redis URL ({exc}); check the "
                              "password (CONVEYOR_REDIS_URL)") from None
    return _backoff(owner, exc, start, delay, deadline_s)


def server_run_id(client: redis.Redis) -> str:
    """The server's ``run_id``: it changes when Redis restarts (or fails over), which is how
    services learn that what they wrote may be gone. "" where the server has no INFO (fakeredis)."""
    try:
        return str(client.info("server").get("run_id", ""))
    except redis.ResponseError:
        return ""


def _pipeline(client: Any, sends: list[Outgoing]) -> Any:
    """A non-transactional pipeline holding the XADDs (and PEXPIREs) of ``sends``."""
    pipe = client.pipeline(transaction=False)
    for out in sends:
        pipe.xadd(out.stream, {ENTRY_FIELD: out.data}, maxlen=out.maxlen, approximate=True)
        if out.ttl_ms is not None:
            pipe.pexpire(out.stream, out.ttl_ms)
    return pipe


def _decode_entry(entry: dict[bytes, bytes], expected: tuple[type, ...] | None, max_bytes: int) -> Any:
    """The message of one stream entry; raises `ProtocolError` if it is not a valid one."""
    data = entry.get(ENTRY_FIELD)
    if data is None:
        raise ProtocolError(f"entry has no {ENTRY_FIELD.decode()!r} field (fields: {sorted(entry)})")
    return decode(data, expected, max_bytes)


def _dead_record(stream: str, entry_id: bytes, entry: dict[bytes, bytes], reason: str,
                 owner: str) -> dict[bytes | str, bytes | str]:
    record: dict[bytes | str, bytes | str] = {"stream": stream, "id": entry_id, "reason": reason, "by": owner}
    for key, value in list(entry.items())[:8]:
        record[b"raw:" + key[:64]] = value[:4096]
    return record


def _backoff(owner: str, exc: BaseException, start: float, delay: float, deadline_s: float | None) -> float:
    """Re-raise ``exc`` past the deadline; else log and return how long to wait before retrying."""
    if deadline_s is not None and time.monotonic() - start + delay > deadline_s:
        raise exc
    logger.warning("%s: redis unavailable (%s); retrying in %.2fs", owner, exc, delay)
    return delay


class Transport:
    """One process's connection to the shared Redis, with protocol encode/decode built in."""

    def __init__(
        self,
        url: str,
        names: Names,
        *,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        owner: str = "?",
    ) -> None:
        self.url = url
        self.names = names
        self.max_message_bytes = max_message_bytes
        self.owner = owner
        self.num_dead_letters = 0
        self.redis = aioredis.from_url(url, **CLIENT_OPTIONS)

    async def close(self) -> None:
        await self.redis.aclose()

    # -- retry ---------------------------------------------------------------------------------
    async def call(self, fn: Any, *args: Any, deadline_s: float | None = None, **kwargs: Any) -> Any:
        """Run ``await fn(*args, **kwargs)``, retrying transient errors with capped backoff.

        ``deadline_s`` None retries forever (service loops); otherwise the last error is raised
        once that many seconds have passed (request paths that must fail fast).
        """
        delay = 0.05
        start = time.monotonic()
        while True:
            try:
                return await fn(*args, **kwargs)
            except TRANSIENT_ERRORS as exc:
                await asyncio.sleep(_backoff_or_raise(self.owner, exc, start, delay, deadline_s))
                delay = min(delay * 2, 2.0)

    async def ping(self, deadline_s: float | None = None) -> None:
        await self.call(self.redis.ping, deadline_s=deadline_s)

    # -- send ----------------------------------------------------------------------------------
    async def send(self, stream: str, msg: Any, *, maxlen: int | None = None, deadline_s: float | None = None) -> bytes:
        """Append one message to ``stream`` (optionally trimmed to about ``maxlen`` entries)."""
        data = encode(msg, self.max_message_bytes)
        return await self.send_raw(stream, data, maxlen=maxlen, deadline_s=deadline_s)

    async def send_raw(self, stream: str, data: bytes, *, maxlen: int | None = None, deadline_s: float | None = None) -> bytes:
        return await self.call(
            self.redis.xadd, stream, {ENTRY_FIELD: data}, maxlen=maxlen, approximate=True, deadline_s=deadline_s
        )

    async def send_many(self, sends: list[Outgoing], deadline_s: float | None = None) -> None:
        """XADD every message (and refresh TTLs) in one pipelined round trip."""
        async def run() -> Any:  # a new pipeline per try: a failed execute() leaves its own empty
            return await _pipeline(self.redis, sends).execute()

        if sends:
            await self.call(run, deadline_s=deadline_s)

    async def trim_through(self, stream: str, entry_id: bytes | str) -> None:
        """Delete the entries of ``stream`` before ``entry_id`` (its single reader has taken them)."""
        await self.call(self.redis.xtrim, stream, minid=entry_id, approximate=False)

    async def run_id(self, deadline_s: float | None = None) -> str:
        """See `server_run_id`."""
        try:
            info = await self.call(self.redis.info, "server", deadline_s=deadline_s)
        except redis.ResponseError:
            return ""
        return str(info.get("run_id", ""))

    # -- receive -------------------------------------------------------------------------------
    async def read(
        self,
        cursors: dict[str, bytes | str],
        *,
        count: int = 256,
        block_ms: int | None = 1000,
        expected: tuple[type, ...] | None = None,
    ) -> list[tuple[str, bytes, Any]]:
        """XREAD from each stream after its cursor; cursors advance in place.

        Returns ``(stream, entry_id, message)``; malformed entries are dead-lettered.
        """
        assert block_ms is None or block_ms <= MAX_BLOCK_MS
        reply = await self.call(self.redis.xread, dict(cursors), count=count, block=block_ms)
        out: list[tuple[str, bytes, Any]] = []
        for stream_name, entries in reply or []:
            stream = stream_name.decode() if isinstance(stream_name, bytes) else stream_name
            for entry_id, entry in entries:
                cursors[stream] = entry_id
                msg = await self._decode_entry(stream, entry_id, entry, expected)
                if msg is not None:
                    out.append((stream, entry_id, msg))
        return out

    async def last_id(self, stream: str) -> bytes:
        """The id of the newest entry of ``stream`` ("0-0" if empty): a cursor for new entries."""
        info = await self.call(self.redis.xrevrange, stream, count=1)
        return info[0][0] if info else b"0-0"

    async def _decode_entry(self, stream: str, entry_id: bytes, entry: dict[bytes, bytes],
                            expected: tuple[type, ...] | None) -> Any:
        try:
            return _decode_entry(entry, expected, self.max_message_bytes)
        except ProtocolError as exc:
            await self.dead_letter(stream, entry_id, entry, str(exc))
            return None

    async def dead_letter(self, stream: str, entry_id: bytes, entry: dict[bytes, bytes], reason: str) -> None:
        """Log a rejected entry and keep a copy (truncated) on the dead-letter stream."""
        self.num_dead_letters += 1
        logger.error("%s: rejected entry %s on %s: %s", self.owner, entry_id, stream, reason)
        record = _dead_record(stream, entry_id, entry, reason, self.owner)
        try:
            await self.call(self.redis.xadd, self.names.dead_letter, record,
                            maxlen=DEAD_LETTER_MAXLEN, approximate=True, deadline_s=5)
        except TRANSIENT_ERRORS:
            logger.exception("could not write the dead letter")

    # -- keys ----------------------------------------------------------------------------------
    def decode_value(self, key: str, data: bytes, expected: tuple[type, ...] | None = None) -> Any:
        """The message in a key's value, or None if malformed (logged)."""
        try:
            return decode(data, expected, self.max_message_bytes)
        except ProtocolError as exc:
            logger.error("%s: malformed value at %s: %s", self.owner, key, exc)
            return None

    async def beat(self, kind: str, process_id: str, ttl_ms: int) -> None:
        """Refresh this process's heartbeat key."""
        await self.call(self.redis.set, self.names.heartbeat(kind, process_id), str(time.time()), px=ttl_ms)

    async def alive(self, kind: str, process_id: str, deadline_s: float | None = None) -> bool:
        return bool(await self.call(self.redis.exists, self.names.heartbeat(kind, process_id), deadline_s=deadline_s))


class SyncTransport:
    """`Transport` with blocking calls, for loops that run one step at a time (scheduler, executor).

    Thread-safe: redis-py's pool gives every concurrent call its own connection, so reader threads
    can block on their streams while the engine thread runs steps.
    """

    def __init__(self, url: str, names: Names, *, max_message_bytes: int = MAX_MESSAGE_BYTES, owner: str = "?") -> None:
        self.url = url
        self.names = names
        self.max_message_bytes = max_message_bytes
        self.owner = owner
        self.num_dead_letters = 0
        self.redis = redis.Redis.from_url(url, **CLIENT_OPTIONS)

    def close(self) -> None:
        self.redis.close()

    def call(self, fn: Any, *args: Any, deadline_s: float | None = None, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with the retry policy of `Transport.call`."""
        delay = 0.05
        start = time.monotonic()
        while True:
            try:
                return fn(*args, **kwargs)
            except TRANSIENT_ERRORS as exc:
                time.sleep(_backoff_or_raise(self.owner, exc, start, delay, deadline_s))
                delay = min(delay * 2, 2.0)

    def ping(self, deadline_s: float | None = None) -> None:
        self.call(self.redis.ping, deadline_s=deadline_s)

    def encode(self, msg: Any) -> bytes:
        return encode(msg, self.max_message_bytes)

    def send(self, stream: str, msg: Any, *, maxlen: int | None = None, deadline_s: float | None = None) -> bytes:
        return self.call(self.redis.xadd, stream, {ENTRY_FIELD: self.encode(msg)}, maxlen=maxlen, approximate=True,
                         deadline_s=deadline_s)

    def exchange(
        self,
        sends: list[Outgoing],
        cursors: dict[str, bytes | str] | None = None,
        *,
        count: int = 256,
        block_ms: int | None = None,
        expected: tuple[type, ...] | None = None,
        deadline_s: float | None = None,
        trim: dict[str, bytes | str] | None = None,
    ) -> list[tuple[str, bytes, Any]]:
        """XADD every message, trim ``trim`` streams before their ids, then XREAD ``cursors``: one
        pipelined round trip.

        A transient error retries the whole exchange, so a message may be appended twice; every
        reader tolerates that (steps and results carry a step number, outputs a token index).
        """
        def run() -> Any:
            pipe = _pipeline(self.redis, sends)
            for stream, entry_id in (trim or {}).items():  # what a single reader has taken (see `trim_through`)
                pipe.xtrim(stream, minid=entry_id, approximate=False)
            if cursors:
                pipe.xread(dict(cursors), count=count, block=block_ms)
            return pipe.execute()

        assert block_ms is None or block_ms <= MAX_BLOCK_MS
        if not sends and not cursors and not trim:
            return []
        replies = self.call(run, deadline_s=deadline_s)
        return self._collect(replies[-1], cursors, expected) if cursors else []

    def read(self, cursors: dict[str, bytes | str], *, count: int = 256, block_ms: int | None = 1000,
             expected: tuple[type, ...] | None = None) -> list[tuple[str, bytes, Any]]:
        """XREAD after each cursor (advanced in place); malformed entries are dead-lettered."""
        assert block_ms is None or block_ms <= MAX_BLOCK_MS
        reply = self.call(self.redis.xread, dict(cursors), count=count, block=block_ms)
        return self._collect(reply, cursors, expected)

    def _collect(self, reply: Any, cursors: dict[str, bytes | str],
                 expected: tuple[type, ...] | None) -> list[tuple[str, bytes, Any]]:
        out: list[tuple[str, bytes, Any]] = []
        for stream_name, entries in reply or []:
            stream = stream_name.decode() if isinstance(stream_name, bytes) else stream_name
            for entry_id, entry in entries:
                cursors[stream] = entry_id
                msg = self._decode(stream, entry_id, entry, expected)
                if msg is not None:
                    out.append((stream, entry_id, msg))
        return out

    def trim_through(self, stream: str, entry_id: bytes | str) -> None:
        """Delete the entries of ``stream`` before ``entry_id`` (its single reader has taken them)."""
        self.call(self.redis.xtrim, stream, minid=entry_id, approximate=False)

    def run_id(self, deadline_s: float | None = None) -> str:
        return str(self.call(server_run_id, self.redis, deadline_s=deadline_s))

    def last_id(self, stream: str) -> bytes:
        info = self.call(self.redis.xrevrange, stream, count=1)
        return info[0][0] if info else b"0-0"

    def _decode(self, stream: str, entry_id: bytes, entry: dict[bytes, bytes], expected: tuple[type, ...] | None) -> Any:
        try:
            return _decode_entry(entry, expected, self.max_message_bytes)
        except ProtocolError as exc:
            self.dead_letter(stream, entry_id, entry, str(exc))
            return None

    def dead_letter(self, stream: str, entry_id: bytes, entry: dict[bytes, bytes], reason: str) -> None:
        self.num_dead_letters += 1
        logger.error("%s: rejected entry %s on %s: %s", self.owner, entry_id, stream, reason)
        record = _dead_record(stream, entry_id, entry, reason, self.owner)
        try:
            self.call(self.redis.xadd, self.names.dead_letter, record, maxlen=DEAD_LETTER_MAXLEN, approximate=True, deadline_s=5)
        except TRANSIENT_ERRORS:
            logger.exception("could not write the dead letter")

    def alive(self, kind: str, process_id: str, deadline_s: float | None = None) -> bool:
        return bool(self.call(self.redis.exists, self.names.heartbeat(kind, process_id), deadline_s=deadline_s))


class Heartbeat:
    """Refreshes ``hb:<kind>:<id>`` every ``interval_s`` on a daemon thread with its own client.

    The first beat happens in `start` (so the process is visible before it serves); later
    failures are logged and retried at the next tick, never fatal.
    """

    def __init__(self, url: str, names: Names, kind: str, process_id: str, interval_s: float, ttl_ms: int) -> None:
        self.key = names.heartbeat(kind, process_id)
        self.interval_s = interval_s
        self.ttl_ms = ttl_ms
        self.redis = redis.Redis.from_url(url, socket_timeout=max(1.0, ttl_ms / 1000), socket_connect_timeout=2.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{kind}", daemon=True)

    def beat(self) -> None:
        self.redis.set(self.key, str(time.time()), px=self.ttl_ms)

    def start(self) -> Heartbeat:
        try:
            self.beat()
        except TRANSIENT_ERRORS as exc:
            logger.warning("first heartbeat of %s failed: %s", self.key, exc)
        self._thread.start()
        return self

    def stop(self, wait_s: float = 0.0) -> None:
        """Stop beating; with ``wait_s``, wait that long for an in-flight beat to finish."""
        self._stop.set()
        if wait_s > 0 and self._thread.is_alive():
            self._thread.join(wait_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except Exception as exc:  # keep beating whatever happens; the loop is the liveness signal
                logger.warning("heartbeat %s failed: %s", self.key, exc)
