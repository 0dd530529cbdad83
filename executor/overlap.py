"""Redis I/O that overlaps a computation: a read sent ahead of need, and writes not waited for.

The executor's step loop used one round trip per step: send the result, then block on reading the
next step. Here the read for the next step leaves *before* the current step runs, on a connection
of its own, and a result leaves without waiting for Redis's answer (read before the next write on
that connection, by when it is in): a step the scheduler sent while the current one ran is in the
socket when it ends. With Redis a network hop away, this and more steps in flight
(`SchedulerConfig.steps_in_flight`) are what keep the executor busy (docs/performance.md).

Each holds one pooled connection while in use, to the server holding its streams
(`SyncTransport.direct`: on a cluster, the master of the engine's hash slot). A failure surfaces as
the transient error it is, and the slot map is read again (`SyncTransport.reroute`); the caller
then repeats the operation with the transport's retrying calls (`WriteBehind.redo`, a new
`PendingRead`), so an entry may be appended twice, which every reader of these streams tolerates
(steps and results carry a step number).
"""

from __future__ import annotations

from typing import Any

import redis

from common.redis_errors import as_transient, refuses_writes
from common.transport import Cursors, Outgoing, Received, SyncTransport


def _send(conn: Any, pipe: Any) -> None:
    """Write a pipeline's commands, as redis-py packs them, without reading any answer."""
    conn.send_packed_command(conn.pack_commands([args for args, _ in pipe.command_stack]))


def _release(client: redis.Redis, conn: Any, *, broken: bool) -> None:
    if broken:
        conn.disconnect()  # answers unread, or a dead socket: nobody may read this connection again
    client.connection_pool.release(conn)


def _failed(transport: SyncTransport, exc: BaseException) -> BaseException:
    """``exc`` as the caller handles it (a cluster's redirection is transient), the slot map re-read."""
    transport.reroute()
    return as_transient(exc)


class PendingRead:
    """One XREAD of ``cursors``, sent now on a connection of its own; `take` returns what it read
    (waiting for it if need be), `ready` says whether that would not wait."""

    def __init__(
        self, transport: SyncTransport, cursors: Cursors, *, count: int, block_ms: int, expected: tuple[type, ...]
    ) -> None:
        self.transport = transport
        self.cursors = cursors
        self.expected = expected
        # redis-py spells and parses the command; only the connection is handled here.
        self.client = transport.direct(next(iter(cursors)))
        self.pipe: Any = transport._pipeline([], None, transport._xread(cursors, count, block_ms), self.client)
        self.conn: Any = None
        try:
            self.conn = self.client.connection_pool.get_connection()
            _send(self.conn, self.pipe)
        except BaseException as exc:
            self.close()
            raise _failed(transport, exc) from None

    def ready(self) -> bool:
        """Whether the answer (or a broken connection, which `take` then raises) is in."""
        return self.conn is None or bool(self.conn.can_read(timeout=0))

    def take(self) -> list[Received]:
        """The entries read (``cursors`` move past them); a transient error if the read failed."""
        args, options = self.pipe.command_stack[0]
        try:
            reply = self.pipe.parse_response(self.conn, args[0], **options)
        except BaseException as exc:
            self.close()
            raise _failed(self.transport, exc) from None
        conn, self.conn = self.conn, None
        _release(self.client, conn, broken=False)
        received, rejected = self.transport._collect(reply, self.cursors, self.expected)
        for bad in rejected:
            self.transport.dead_letter(*bad)
        return received

    def close(self) -> None:
        """Give the connection back unanswered: it is dropped, since a blocked XREAD cannot be recalled."""
        if self.conn is not None:
            conn, self.conn = self.conn, None
            _release(self.client, conn, broken=True)


class WriteBehind:
    """XADDs (with their TTLs, and trims) sent without waiting for the answers, on a connection held
    for the purpose. The answers of one `send` are read at the next (or at `settle`): XADD, PEXPIRE
    and XTRIM never block, so by then they are in. Until they are read, what was sent is kept for
    `redo`."""

    def __init__(self, transport: SyncTransport) -> None:
        self.transport = transport
        self.conn: Any = None
        self.client: Any = None  # whose connection ``conn`` is
        self.pipe: Any = None
        self.unconfirmed: tuple[list[Outgoing], Cursors | None] | None = None

    def send(self, sends: list[Outgoing], trim: Cursors | None = None) -> None:
        """Send now; a transient error if this or the previous send failed (then `redo`, which
        sends both)."""
        try:
            self.settle()
        except BaseException:
            if self.unconfirmed is not None and (sends or trim):  # never sent: redone with the previous
                old_sends, old_trim = self.unconfirmed
                self.unconfirmed = (old_sends + sends, {**(old_trim or {}), **(trim or {})} or None)
            raise
        if not sends and not trim:
            return
        client = self.transport.direct(sends[0].stream if sends else next(iter(trim or {})))
        if client is not self.client:  # a cluster's slot moved to another master
            self.close()
        self.pipe = self.transport._pipeline(sends, trim, None, client)
        self.unconfirmed = (sends, dict(trim) if trim else None)
        try:
            if self.conn is None:
                self.client, self.conn = client, client.connection_pool.get_connection()
            _send(self.conn, self.pipe)
        except BaseException as exc:
            self.close()
            raise _failed(self.transport, exc) from None

    def settle(self) -> None:
        """Read the answers of the last send; a command Redis refused raises, as in a pipeline."""
        if self.unconfirmed is None or self.conn is None:
            return
        errors = []
        try:
            for args, options in self.pipe.command_stack:
                try:
                    self.pipe.parse_response(self.conn, args[0], **options)
                except redis.ResponseError as exc:
                    errors.append(exc)
        except BaseException as exc:
            self.close()
            raise _failed(self.transport, exc) from None
        if any(refuses_writes(e) for e in errors):  # kept for `redo`: Redis takes writes again soon
            raise as_transient(next(e for e in errors if refuses_writes(e)))
        self.unconfirmed = None
        if errors:
            raise errors[0]

    def redo(self) -> None:
        """After a failure: send what may not have arrived again, with the transport's retries."""
        self.close()
        if self.unconfirmed is not None:
            sends, trim = self.unconfirmed
            self.unconfirmed = None
            self.transport.exchange(sends, trim=trim)

    def close(self) -> None:
        """Give the connection back; with answers unread it is dropped, and what it carried stays
        for `redo`."""
        if self.conn is not None:
            conn, self.conn = self.conn, None
            _release(self.client, conn, broken=self.unconfirmed is not None)
